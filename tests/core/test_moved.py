"""Moved names (megatron_sft_idx._moved): an old module warns once, naming its new home and the
version that removes it, and still gives the same objects; an old name whose home is above its
old module warns and fails, naming the new home; preprocess.repack is the repack function."""

import importlib
import sys
import warnings

import pytest

from megatron_sft_idx import _moved

WORKING = sorted(name for name, moved in _moved.MOVED_MODULES.items() if moved.works)


def _fresh_import(name: str):
    sys.modules.pop(name, None)
    _moved._warned.discard(name)
    return importlib.import_module(name)


@pytest.mark.parametrize("name", WORKING)
def test_an_old_module_warns_once_at_the_importing_line_and_gives_the_same_objects(name):
    moved = _moved.MOVED_MODULES[name]
    with pytest.warns(FutureWarning) as caught:
        old = _fresh_import(name)
    texts = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert texts == [f"{name} is deprecated and will be removed in megatron_sft_idx {moved.removal}: "
                     f"import from {moved.new}"]
    assert caught[0].filename == __file__  # the line that imported it, not the import machinery
    for attr in old.__all__:  # each class or function is defined in a new home the table names
        home = getattr(getattr(old, attr), "__module__", None)
        if home is not None and home.startswith("megatron_sft_idx."):
            assert f"{home} " in moved.new or f".{home.rsplit('.', 1)[1]} " in moved.new, (attr, home, moved.new)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sys.modules.pop(name)
        importlib.import_module(name)  # once per process: a second import is quiet


def test_the_repack_module_name_is_the_repack_function():
    import megatron_sft_idx.preprocess as face
    from megatron_sft_idx.preprocess import driver, repack

    assert repack is driver.repack is face.repack
    assert not _moved.MOVED_MODULES["megatron_sft_idx.preprocess.repack"].works
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("megatron_sft_idx.preprocess.repack")


@pytest.mark.parametrize("old", sorted(_moved.MOVED_NAMES))
def test_an_old_name_above_its_module_warns_and_fails_naming_its_home(old):
    module, name = old.rsplit(".", 1)
    new = _moved.MOVED_NAMES[old].new
    mod = importlib.import_module(module)
    with pytest.warns(FutureWarning, match=f"{old} was removed") as caught:
        with pytest.raises(AttributeError, match=f"import from {new.split(' ')[0]}"):
            getattr(mod, name)
    assert new.split(" ")[0] in str(caught[0].message)
    assert name not in getattr(mod, "__all__", ())
    # the new home holds it
    home = new.split(" ")[0]
    home_module, home_name = home.rsplit(".", 1)
    assert getattr(importlib.import_module(home_module), home_name) is not None


def test_other_missing_names_are_plain_attribute_errors():
    import megatron_sft_idx.storage as storage
    from megatron_sft_idx.storage import upload

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for mod in (storage, upload):
            with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
                mod.nothing_here
        assert storage.StorageConfig.__name__ == "StorageConfig"  # the lazy face still answers
