"""arctic-inference, the suffix tree's provider: whether it imports, and how to install it when not.

The plugin registers ``suffix`` without importing arctic-inference, so that ``aphrodite plugins``
lists the method and choosing it without the library fails at configuration time with the install
command, before any weight is loaded, instead of an ImportError deep inside engine start-up.
"""

from __future__ import annotations

import importlib
from importlib import metadata

from sonar_core.errors import ConfigError

ARCTIC_MODULE = "arctic_inference.suffix_decoding"


def check_arctic_inference() -> None:
    """Import the suffix tree module; raise :class:`ConfigError` with the install command if it fails.

    Any ImportError counts (the package is absent, numpy is absent, or its compiled extension does
    not load): each is fixed by (re)installing the plugin with its dependencies.
    """
    try:
        importlib.import_module(ARCTIC_MODULE)
    except ImportError as exc:
        raise missing_arctic_error(exc) from None


def missing_arctic_error(cause: ImportError) -> ConfigError:
    """The error shown when arctic-inference cannot be imported, naming the command that fixes it."""
    torch_pin = _torch_pin()
    return ConfigError(
        "method",
        f"method 'suffix' drafts from arctic-inference's suffix trees, but {ARCTIC_MODULE} cannot be "
        f"imported ({cause})",
        "install the plugin with its dependencies: pip install -e plugins/sonar-suffix (in a Sonar checkout). "
        "arctic-inference ships only "
        "as source and its build asks for torch; pass a constraint file so that the build uses the "
        f"torch installed here instead of downloading another: echo '{torch_pin}' > constraints.txt && "
        "PIP_CONSTRAINT=constraints.txt pip install -e plugins/sonar-suffix (scripts/install.sh does this)",
    )


def _torch_pin() -> str:
    """``torch==X.Y.Z`` for the installed torch, without its local tag (``+cpu``), which pip ignores."""
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "torch==<your torch version>"
    return f"torch=={version.split('+', 1)[0]}"
