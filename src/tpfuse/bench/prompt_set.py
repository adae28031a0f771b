"""A small prompt set shipped with the package (`--dataset builtin`): varied, short, no download."""

BUILTIN_PROMPTS = (
    "Explain how a transformer decoder generates text one token at a time.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List ten practical tips for reducing the latency of a web service.",
    "Describe the water cycle to a ten-year-old.",
    "What are the trade-offs between tensor parallelism and pipeline parallelism?",
    "Write a Python function that merges two sorted lists, and explain its complexity.",
    "Summarize the causes and consequences of the industrial revolution.",
    "Compose a poem about autumn rain in a quiet city.",
    "How does a CPU cache work, and why does memory layout matter for performance?",
    "Give a recipe for a vegetarian lasagna with step-by-step instructions.",
    "Explain the difference between latency and throughput with everyday examples.",
    "Write a dialogue between a teacher and a student about prime numbers.",
    "What should a beginner know before running their first marathon?",
    "Describe how public-key cryptography lets two strangers agree on a secret.",
    "Translate the idea of compound interest into a simple story.",
    "Plan a three-day trip to a mountain town, with a schedule for each day.",
)
