# accelerate_c/utils/versions.py: HF's `accelerate.utils.versions` names, re-exported from base/imports.py.
# Not for: behaviour of its own.
from ..base.imports import compare_versions, is_torch_version

__all__ = ["compare_versions", "is_torch_version"]
