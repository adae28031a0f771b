"""Counts an executor's plain launches, and those made while an earlier launch was still unread
(launched ahead: the overlap schedule)."""


def count_launches(executor) -> dict:
    """Wraps executor.launch / executor.wait in place; returns the live counts {"total", "ahead"}."""
    counts = {"total": 0, "ahead": 0}
    unread = []
    launch, wait = executor.launch, executor.wait

    def counting_launch(batch, packed):
        counts["total"] += 1
        counts["ahead"] += bool(unread)
        pending = launch(batch, packed)
        unread.append(pending)
        return pending

    def counting_wait(pending):
        if any(p is pending for p in unread):
            unread.remove(next(p for p in unread if p is pending))
        return wait(pending)

    executor.launch, executor.wait = counting_launch, counting_wait
    return counts
