"""Every drafter class really implements the Drafter interface (spec/drafter.py): each abstract method
of its interface is defined by the class itself or a concrete base, none is a stub that raises
NotImplementedError, and the drafter classes found by walking the subclasses are exactly the known
ones (a new drafter is checked here once it exists). The engine's SpecWorker holds such a drafter."""

import ast
import inspect
import textwrap

import pytest

from tpfuse.spec.draft_model import DraftModelDrafter
from tpfuse.spec.drafter import Drafter, TreeDrafter
from tpfuse.spec.eagle3_drafter import Eagle3Drafter
from tpfuse.spec.mtp import MtpDrafter
from tpfuse.spec.ngram import NgramDrafter

DRAFTERS = {  # each drafter class: the interface it implements
    NgramDrafter: Drafter,
    DraftModelDrafter: Drafter,
    MtpDrafter: Drafter,
    Eagle3Drafter: TreeDrafter,
}


def _all_subclasses(cls) -> set:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub} | _all_subclasses(sub)
    return found


def _raises_not_implemented(function) -> bool:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name) and target.id == "NotImplementedError":
                return True
    return False


def test_the_concrete_drafters_are_exactly_the_known_ones():
    concrete = {
        cls
        for cls in _all_subclasses(Drafter)
        if not inspect.isabstract(cls) and cls.__module__.startswith("tpfuse.")
    }
    assert concrete == set(DRAFTERS), "add the new drafter to DRAFTERS (and its interface)"


@pytest.mark.parametrize("cls", list(DRAFTERS), ids=lambda c: c.__name__)
def test_each_drafter_implements_every_method_of_its_interface(cls):
    interface = DRAFTERS[cls]
    assert issubclass(cls, interface) and not inspect.isabstract(cls)
    for name in interface.__abstractmethods__:
        method = getattr(cls, name)
        assert not getattr(method, "__isabstractmethod__", False), f"{cls.__name__}.{name} is abstract"
        assert method is not getattr(interface, name), f"{cls.__name__} inherits the abstract {name}"
        assert not _raises_not_implemented(method), f"{cls.__name__}.{name} is a NotImplementedError stub"
        signature = inspect.signature(method)
        assert list(signature.parameters) == list(inspect.signature(getattr(interface, name)).parameters)


def test_only_tree_drafters_offer_propose_tree():
    for cls, interface in DRAFTERS.items():
        assert hasattr(cls, "propose_tree") == (interface is TreeDrafter), cls.__name__


def test_the_stub_detector_finds_a_stub():
    class Stub(Drafter):
        def propose(self, inputs, num_draft_tokens):
            raise NotImplementedError("later")

    assert _raises_not_implemented(Stub.propose)
    assert not _raises_not_implemented(NgramDrafter.propose)
