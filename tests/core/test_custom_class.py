"""The custom_class method: a user's proposer class, with one distinct error per kind of mistake."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from sonar_core.builtin_methods.custom_class import (
    CustomClassError,
    CustomClassImportError,
    CustomClassModuleNotFoundError,
    CustomClassNotAProposerError,
    CustomClassNotFoundError,
    load_custom_class,
    split_class_path,
)
from sonar_core.config import validate_speculative_config
from sonar_core.errors import ConfigError
from sonar_core.plugins import get_plugin_manager
from sonar_core.spec_decode.proposer import ProposalRequest, ProposeBatch, ProposerContext

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_proposer.py"

MODULES = {
    "good_proposers.py": """
        from sonar_core.spec_decode.proposer import DraftProposal, Proposer

        class Constant(Proposer):
            def __init__(self, context, token=0):
                self.token = token

            def propose(self, batch):
                return DraftProposal(token_ids=[[self.token] * r.max_draft_tokens for r in batch.requests])

        class Abstract(Proposer):
            pass

        class NotAProposer:
            def propose(self, batch):
                return None

        def factory(context):
            return Constant(context)

        class Outer:
            Inner = Constant
    """,
    "broken_proposers.py": "raise RuntimeError('broken on purpose')\n",
    "needs_missing_dep.py": "import sonar_dependency_that_is_not_installed\n",
}


@pytest.fixture(scope="module")
def user_modules(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user_code")
    for name, source in MODULES.items():
        (folder / name).write_text(textwrap.dedent(source))
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    for name in MODULES:
        sys.modules.pop(name.removesuffix(".py"), None)


@pytest.fixture(scope="module")
def manager():
    return get_plugin_manager(environ={"SONAR_PLUGINS": "custom_class"})


def validate(manager, **keys):
    return validate_speculative_config({"method": "custom_class", "num_speculative_tokens": 3, **keys}, None, manager)


@pytest.mark.parametrize(
    ("path", "expected"),
    [("pkg.mod:Cls", ("pkg.mod", "Cls")), ("pkg.mod.Cls", ("pkg.mod", "Cls")), ("a/b.py:Cls", ("a/b.py", "Cls")),
     ("mod:Outer.Inner", ("mod", "Outer.Inner"))],
)
def test_class_path_forms(path, expected):
    assert split_class_path(path) == expected


@pytest.mark.parametrize("path", ["Cls", "mod:", ":Cls", "mod:not-a-name"])
def test_malformed_class_path(path):
    with pytest.raises(CustomClassError, match="is not an import path of a class"):
        split_class_path(path)


def test_loads_a_class_by_module_path(user_modules):
    assert load_custom_class("good_proposers:Constant").__name__ == "Constant"
    assert load_custom_class("good_proposers.Constant").__name__ == "Constant"
    assert load_custom_class("good_proposers:Outer.Inner").__name__ == "Constant"


def test_loads_a_class_from_a_file(user_modules):
    assert load_custom_class(f"{user_modules / 'good_proposers.py'}:Constant").__name__ == "Constant"


def test_module_not_found(user_modules):
    with pytest.raises(CustomClassModuleNotFoundError) as info:
        load_custom_class("no_such_package.module:Cls")
    assert "was not found on the import path" in info.value.message
    assert "PYTHONPATH" in info.value.fix


def test_file_not_found(tmp_path):
    with pytest.raises(CustomClassModuleNotFoundError, match="does not exist"):
        load_custom_class(f"{tmp_path / 'missing.py'}:Cls")


@pytest.mark.parametrize(
    ("path", "cause"),
    [("broken_proposers:Cls", "RuntimeError: broken on purpose"),
     ("needs_missing_dep:Cls", "No module named 'sonar_dependency_that_is_not_installed'")],
)
def test_module_that_fails_to_import(user_modules, path, cause):
    with pytest.raises(CustomClassImportError) as info:
        load_custom_class(path)
    assert "was found, but importing it raised" in info.value.message and cause in info.value.message


def test_class_not_found(user_modules):
    with pytest.raises(CustomClassNotFoundError) as info:
        load_custom_class("good_proposers:Constnat")
    assert "classes defined there: Abstract, Constant, NotAProposer, Outer" in info.value.message


@pytest.mark.parametrize(
    ("path", "reason"),
    [("good_proposers:NotAProposer", "not a subclass of Proposer"),
     ("good_proposers:Abstract", "leaves abstract methods unimplemented: propose"),
     ("good_proposers:factory", "is a function, not a class")],
)
def test_not_a_proposer(user_modules, path, reason):
    with pytest.raises(CustomClassNotAProposerError) as info:
        load_custom_class(path)
    assert reason in info.value.message
    assert "subclass sonar_core.spec_decode.proposer.Proposer" in info.value.fix


def test_errors_are_config_errors_on_the_custom_class_field(user_modules):
    with pytest.raises(ConfigError) as info:
        load_custom_class("good_proposers:Abstract")
    assert info.value.field == "speculative_config.custom_class"


def test_validation_imports_the_class(user_modules, manager):
    with pytest.raises(CustomClassNotFoundError):
        validate(manager, custom_class="good_proposers:Missing")
    resolved = validate(manager, custom_class="good_proposers:Constant", options={"token": 9})
    assert resolved.options.custom_class == "good_proposers:Constant"


def test_class_path_is_required(manager):
    with pytest.raises(ConfigError) as info:
        validate(manager)
    assert info.value.field == "speculative_config.custom_class"
    assert "package.module:ClassName" in info.value.fix


def test_unknown_key_is_rejected(manager):
    with pytest.raises(ConfigError) as info:
        validate(manager, custom_class="x:Y", option={"a": 1})
    assert "not an option of method 'custom_class'" in info.value.message
    assert "did you mean 'options'?" in info.value.fix


def test_options_must_fit_the_constructor(user_modules, manager):
    with pytest.raises(ConfigError) as info:
        validate(manager, custom_class="good_proposers:Constant", options={"colour": "red"})
    assert info.value.field == "speculative_config.options"
    assert "colour" in info.value.message


def build(manager, resolved):
    context = ProposerContext(
        speculative_config=resolved.config, method_options=resolved.options, target_model=None,
        target_hf_config=None, target_tokenizer=None, dtype=None, device=None, max_model_len=128,
    )
    return manager.create_proposer(resolved, context)


def propose(proposer, tokens, budget=3):
    request = ProposalRequest(request_id="r", token_ids=tokens, num_new_tokens=len(tokens), max_draft_tokens=budget,
                              block_table=[0])
    batch = ProposeBatch(requests=[request], block_size=16, kv_caches=[], device=None)
    return proposer.propose(batch).token_ids[0]


def test_options_reach_the_constructor(user_modules, manager):
    resolved = validate(manager, custom_class="good_proposers:Constant", options={"token": 9})
    assert propose(build(manager, resolved), [1, 2]) == [9, 9, 9]


def test_the_example_custom_proposer(manager):
    resolved = validate(manager, custom_class=f"{EXAMPLE}:RepeatRunProposer", options={"min_run": 3})
    proposer = build(manager, resolved)
    assert propose(proposer, [4, 7, 7, 7]) == [7, 7, 7]
    assert propose(proposer, [4, 4, 7, 7]) == []
    assert propose(proposer, [7, 7]) == []
