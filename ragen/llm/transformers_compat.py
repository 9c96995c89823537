"""Differences between transformers versions that more than one module meets.

``dtype_kwarg``: the name of ``from_pretrained``'s dtype argument. It lives here,
not in ``ragen.llm.hf``, so that ``ragen.llm.default_model`` (which ``hf``
imports) can use it without importing ``hf`` back.
"""

from __future__ import annotations

from typing import Any


def dtype_kwarg(dtype: Any) -> dict[str, Any]:
    """``from_pretrained``'s dtype argument: ``dtype`` since transformers 4.56, ``torch_dtype`` before."""
    import transformers
    from packaging.version import Version

    new = Version(transformers.__version__.split("+")[0]) >= Version("4.56")
    return {"dtype" if new else "torch_dtype": dtype}
