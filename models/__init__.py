"""Model modules and their weights. Importing it first checks that the `kernels` name is this project's."""

import importlib.metadata


def hub_kernels_clash() -> str | None:
    """Why this project cannot run beside an installed Hugging Face `kernels` distribution, or None.

    Its import name is the name of this project's `kernels/` package, so whichever comes first on the path
    hides the other: transformers >= 5.25 requires it (pyproject pins transformers below that) and imports
    it with transformers' own modules.
    """
    try:
        version = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None
    return (
        f"Hugging Face's `kernels` {version} is installed, and its import name is this project's `kernels` "
        "package: one hides the other. Uninstall it (`pip uninstall kernels`) and keep transformers < 5.25, "
        "which does not require it."
    )


if (_clash := hub_kernels_clash()) is not None:
    raise ImportError(_clash)
