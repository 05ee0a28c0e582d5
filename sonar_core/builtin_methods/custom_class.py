"""The ``custom_class`` method: a user's proposer class, named by its import path.

    speculative_config={
        "method": "custom_class",
        "custom_class": "my_package.my_module:MyProposer",   # or "my_package.my_module.MyProposer",
        "num_speculative_tokens": 4,                          # or "path/to/file.py:MyProposer"
        "options": {"table_size": 1024},                      # keyword arguments of the constructor
    }

The class must subclass :class:`~sonar_core.spec_decode.proposer.Proposer`; it is built as
``MyProposer(context, **options)``. The class is imported while the configuration is validated, so
a wrong path fails at startup with one of four distinct errors: the module does not exist, the
module fails to import, the class is not in the module, or it is not a proposer.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sonar_core.config.speculative import METHOD_SPECIFIC_FIELDS
from sonar_core.errors import ConfigError
from sonar_core.plugins import MethodSpec, hookimpl

if TYPE_CHECKING:
    from sonar_core.config import SpeculativeConfig, TargetInfo
    from sonar_core.plugins import MethodRegistry
    from sonar_core.spec_decode.proposer import Proposer, ProposerContext

METHOD = "custom_class"
FIELD = "speculative_config.custom_class"
_PATH_FIX = 'write "custom_class": "package.module:ClassName" (or "path/to/file.py:ClassName")'


class CustomClassError(ConfigError):
    """``custom_class`` does not name a usable proposer class."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(FIELD, message, fix)


class CustomClassModuleNotFoundError(CustomClassError):
    """The module (or file) of ``custom_class`` does not exist on the import path."""


class CustomClassImportError(CustomClassError):
    """The module exists but raised an exception while it was imported."""


class CustomClassNotFoundError(CustomClassError):
    """The module has no attribute of the class name."""


class CustomClassNotAProposerError(CustomClassError):
    """The attribute is not a concrete subclass of Proposer."""


class CustomClassOptions(BaseModel):
    """The keys the ``custom_class`` method accepts beyond the core fields."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    custom_class: str
    """Import path of the proposer class: ``package.module:Class``, ``package.module.Class`` or
    ``path/to/file.py:Class``."""

    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to the class: ``Class(context, **options)``."""

    @model_validator(mode="before")
    @classmethod
    def _class_is_named(cls, data: Any) -> Any:
        if isinstance(data, dict) and "custom_class" not in data:
            raise ConfigError(FIELD, "method 'custom_class' needs the import path of the proposer class", _PATH_FIX)
        return data


def split_class_path(path: str) -> tuple[str, str]:
    """``(module or file, attribute path)`` of ``pkg.mod:Cls``, ``pkg.mod.Cls`` or ``file.py:Cls``."""
    module, sep, attribute = path.strip().partition(":")
    if not sep:
        module, _, attribute = module.rpartition(".")
    if not module or not attribute or not all(part.isidentifier() for part in attribute.split(".")):
        raise CustomClassError(f"{path!r} is not an import path of a class", _PATH_FIX)
    return module, attribute


def load_custom_class(path: str) -> type[Proposer]:
    """Import the class that ``path`` names and check that it is a concrete Proposer."""
    module_name, attribute = split_class_path(path)
    module = _import_module(module_name)
    found: Any = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            classes = sorted(name for name, value in vars(module).items() if inspect.isclass(value)
                             and value.__module__ == module.__name__)
            raise CustomClassNotFoundError(
                f"module {module_name!r} has no {attribute!r}; classes defined there: {', '.join(classes) or 'none'}",
                "check the class name (it is case-sensitive) and that it is defined at the module's top level",
            )
        found = getattr(found, part)
    return _as_proposer_class(found, path)


def _import_module(module_name: str) -> Any:
    if module_name.endswith(".py"):
        return _import_file(Path(module_name).expanduser())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise CustomClassModuleNotFoundError(
                f"module {module_name!r} was not found on the import path",
                "install the package that holds it, or add its folder to PYTHONPATH (the aphrodite "
                "command does not look in the current directory); a file can also be named as "
                '"path/to/file.py:ClassName"',
            ) from None
        raise _import_failed(module_name, exc) from None
    except Exception as exc:
        raise _import_failed(module_name, exc) from None


def _import_file(file: Path) -> Any:
    if not file.is_file():
        raise CustomClassModuleNotFoundError(
            f"the file {str(file)!r} does not exist (relative paths start at {str(Path.cwd())!r})",
            "give the path of the Python file that defines the class",
        )
    name = f"sonar_custom_class_{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise CustomClassModuleNotFoundError(f"{str(file)!r} cannot be loaded as a Python module", _PATH_FIX)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise _import_failed(str(file), exc) from None
    return module


def _import_failed(module_name: str, exc: BaseException) -> CustomClassImportError:
    return CustomClassImportError(
        f"module {module_name!r} was found, but importing it raised {type(exc).__name__}: {exc}",
        "fix the error in that module, or install what it imports",
    )


def _as_proposer_class(found: Any, path: str) -> type[Proposer]:
    from sonar_core.spec_decode.proposer import Proposer

    implement = "subclass sonar_core.spec_decode.proposer.Proposer and implement propose(batch)"
    if not inspect.isclass(found):
        raise CustomClassNotAProposerError(f"{path!r} is a {type(found).__name__}, not a class", implement)
    if not issubclass(found, Proposer):
        raise CustomClassNotAProposerError(
            f"{path!r} does not implement the proposer interface: it is not a subclass of Proposer",
            implement,
        )
    if inspect.isabstract(found):
        missing = ", ".join(sorted(found.__abstractmethods__))
        raise CustomClassNotAProposerError(f"{path!r} leaves abstract methods unimplemented: {missing}", implement)
    return found


def _check_constructor(cls: type[Proposer], options: dict[str, Any], path: str) -> None:
    try:
        inspect.signature(cls).bind(None, **options)
    except TypeError as exc:
        raise ConfigError(
            "speculative_config.options",
            f"the options do not fit the constructor of {path!r} {inspect.signature(cls)}: {exc}",
            "pass the keyword arguments the class accepts after its context argument",
        ) from None


def create_proposer(context: ProposerContext, weights: dict[str, Any] | None) -> Proposer:
    """``Class(context, **options)``; the class loads its own weights, if any."""
    options: CustomClassOptions = context.method_options
    cls = load_custom_class(options.custom_class)
    return cls(context, **options.options)


@hookimpl
def sonar_register_methods(registry: MethodRegistry) -> None:
    registry.register(
        MethodSpec(
            name=METHOD,
            create_proposer=create_proposer,
            description="A user-provided proposer class (speculative_config.custom_class)",
            options_model=CustomClassOptions,
            # The user's class reads the whole configuration: any field may mean something to it.
            core_fields=frozenset(METHOD_SPECIFIC_FIELDS),
        )
    )


@hookimpl
def sonar_validate_speculative_config(
    config: SpeculativeConfig, target: TargetInfo | None, options: CustomClassOptions | None
) -> list[str] | None:
    """Import the class now, so that a wrong path fails at startup and not at the first request."""
    if config.method != METHOD:
        return None
    cls = load_custom_class(options.custom_class)
    _check_constructor(cls, options.options, options.custom_class)
    return None
