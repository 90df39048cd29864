"""The one rule for a test that needs a side stack of ``make install-compat`` (``.deps/<name>``:
megatron stacks, transformers 5.24, mistral_common): not installed, it fails under CI (``CI``
set: a missing stack is a broken install, never coverage) and is skipped elsewhere."""

import os

import pytest


def require(installed: bool, where: str) -> None:
    """Fail (under CI) or skip unless ``installed``; ``where`` names the stack's directory."""
    if installed:
        return
    message = f"{where} is not installed: run `make install-compat`"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)
