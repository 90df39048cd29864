"""One location type (storage/destination.py): the same calls, the same answers, on a local
directory and on S3 (moto behind the proxy of tests/conftest.py) -- names, listing, sizes,
staging, the publishing primitives, reading back."""

import os

import pytest

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.storage.destination import (Destination, Expect, LocalDestination, ObjectDestination,
                                                  destination_for)


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path):
    """``(destination, directory)``: an empty directory at a destination of each kind."""
    if request.param == "local":
        directory = str(tmp_path / "out")
        os.makedirs(directory)
        return LocalDestination(), directory
    bucket = request.getfixturevalue("bucket")
    return ObjectDestination(), f"s3://{bucket}/out"


def test_destination_for_is_the_one_place_a_path_is_told_from_a_url():
    assert isinstance(destination_for("/data/x"), LocalDestination)
    assert isinstance(destination_for("s3://b/x"), ObjectDestination)
    assert isinstance(destination_for("msc://profile/x"), ObjectDestination)


def test_one_interface_for_both_kinds(place, tmp_path):
    dest, directory = place
    final = dest.join(directory, "ds_000000")
    assert dest.name(final) == "ds_000000" and dest.normal(final).endswith("/out/ds_000000")
    assert dest.normal(dest.parent(final)) == dest.normal(directory)
    assert dest.same(final, final) and not dest.same(final, dest.join(directory, "other"))
    assert dest.listing(final) == {} and dest.existing(final) == [] and not dest.exists(final + ".idx")
    local = tmp_path / "src.bin"
    local.write_bytes(b"0123456789")
    dest.put(str(local), final + ".bin")
    dest.write_bytes(final + ".idx", b"index")
    dest.write_bytes(dest.join(directory, "ds.json"), b"{}")
    assert local.exists() != dest.moves                    # a move takes the staged file, an upload copies it
    assert sorted(dest.existing(final)) == [".bin", ".idx"]
    assert sorted(dest.listing(final).values()) == [5, 10]
    assert dest.sizes([final + ".bin", final + ".seq.bin"]) == {final + ".bin": 10}
    assert dest.read(final + ".idx", 100) == b"index" and dest.read_head(final + ".bin", 4) == b"0123"
    assert dest.read(final + ".loss.bin", 100) is None
    with pytest.raises(ShardError):
        dest.read(final + ".bin", 5)
    stamp = dest.stamp(final + ".idx")
    dest.write_bytes(final + ".idx", b"INDEX")
    assert stamp is not None and dest.stamp(final + ".idx") != stamp   # a publish is seen as a new file
    problems = dest.read_back([Expect(final + ".bin", 10, head=b"0123"), Expect(final + ".idx", 5, head=b"index"),
                               Expect(final + ".seq.idx", 3), Expect(dest.join(directory, "ds.json"), None)])
    assert problems == [(final + ".idx", "its header differs from what was published"),
                        (final + ".seq.idx", "missing"),
                        (dest.join(directory, "ds.json"), "an old file the new generation does not bring is still there")]
    dest.remove([final + ".bin", final + ".idx", dest.join(directory, "ds.json")])
    assert dest.listing(final) == {} and dest.read_back([Expect(final + ".idx", None)]) == []


def test_staging_is_beside_a_local_output_and_a_temporary_directory_for_a_url(place, tmp_path):
    dest, directory = place
    output = dest.join(directory, "merged")
    with dest.staging(output, str(tmp_path / "stage")) as staged:
        assert os.path.basename(staged) == "merged" and os.path.isdir(os.path.dirname(staged))
        if dest.moves:   # a rename into place: the same filesystem, a hidden name beside the output
            assert os.path.dirname(os.path.dirname(staged)) == directory
        else:
            assert staged.startswith(str(tmp_path / "stage"))
    assert not os.path.exists(os.path.dirname(staged))
    work = dest.work_prefix(output, str(tmp_path / "stage"))
    assert work == output if dest.moves else work.startswith(str(tmp_path / "stage")) and work.endswith("/merged")


def test_an_object_output_prefix_must_name_its_outputs(bucket, tmp_path):
    with pytest.raises(ShardError, match="must end in the shards' name"):
        ObjectDestination().work_prefix(f"s3://{bucket}/dir/", str(tmp_path))


def _public(cls) -> set:
    return {n for n in dir(cls) if not n.startswith("_")}


def test_destination_is_an_abstract_interface_both_kinds_implement_whole():
    assert Destination.__abstractmethods__ and not LocalDestination.__abstractmethods__
    assert not ObjectDestination.__abstractmethods__
    # what a writer can call on one kind it can call on the other: nothing asks which kind it is
    assert _public(LocalDestination) == _public(ObjectDestination) == _public(Destination)

    partial = type("Partial", (Destination,), {n: getattr(LocalDestination, n)   # the interface but one method
                                               for n in Destination.__abstractmethods__ if n != "put"})
    with pytest.raises(TypeError, match="abstract method.* put"):
        partial()
