"""Shards that know their set, and every multi-shard reader refusing what is not one whole,
agreeing set (issue 21, items 7 and 10): the rules against a model (property tests), each
difference named in words, and every reader -- open_packed, MultiShardDataset, manifests,
merge-shards, inspect-idx / SQL, write-sft-manifest, Bridge's datasets -- on real shards
holding an incomplete set, two generations, two sets, or a set and strangers."""

import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.shardgen import random_packs, write_shard

from megatron_sft_idx.errors import IncompatibleShardsError, MetadataError, ShardError, ShardSetError
from megatron_sft_idx.format import ALL_SUFFIXES
from megatron_sft_idx.metadata import ShardSet
from megatron_sft_idx.reader import MMapIndexedDataset
from megatron_sft_idx.sets import ShardIdentity, require_compatible, require_whole_sets
from megatron_sft_idx.multi import MultiShardDataset
from megatron_sft_idx.open import open_packed
from megatron_sft_idx.publishing import write_manifest

LLAMA = {"name": "meta-llama/Llama-3.1-8B-Instruct", "files_sha256": "a" * 64, "chat_template_sha256": "c" * 64}
DEEPSEEK = {"name": "deepseek-ai/DeepSeek-V3", "files_sha256": "d" * 64, "chat_template_sha256": "e" * 64}


def member(path, set_id, index, count, *, name="train", n=4, seed=0, overwrite=False, **meta):
    """A small real shard recording membership ``index`` of ``count`` in set ``set_id``."""
    rng = np.random.default_rng(seed * 1000 + index)
    packs = random_packs(rng, n, pack_size=32, pad_mult=meta.get("pad_seq_to_mult", 1))
    s = None if set_id is None else {"id": set_id, "index": index, "count": count, "name": name}
    write_shard(str(path), packs, pack_size=32, vocab_size=1000, overwrite=overwrite,
                metadata=dict(meta, **({"set": s} if s else {})))
    return str(path)


def identity(**kw):
    base = dict(token_dtype="uint16", vocab_size=1000, loss_mask_convention="label_aligned", pad_seq_to_mult=1,
                pad_layout="stored", parallelism=None, tokenizer=None, shard_set=None)
    base.update(kw)
    return ShardIdentity(**base)


# --------------------------------------------------------------------------- the set rule, against a model


def model_verdict(members, selected_by):
    """None when the members form whole sets for this kind of selection, else the rule broken."""
    if selected_by == "prefix":
        return None
    ids = {s.id for _, s in members if s is not None}
    strangers = [p for p, s in members if s is None]
    if selected_by in ("directory", "glob") and (len(ids) > 1 or (ids and strangers)):
        return "several"
    for i in sorted(ids):
        indices = [s.index for _, s in members if s is not None and s.id == i]
        count = next(s.count for _, s in members if s is not None and s.id == i)
        if len(indices) != len(set(indices)):
            return "twice"
        if set(indices) != set(range(count)):
            return "incomplete"
    return None


@st.composite
def selections(draw):
    sets = draw(st.lists(st.integers(1, 6), min_size=0, max_size=3))
    members = []
    for k, count in enumerate(sets):
        present = draw(st.lists(st.integers(0, count - 1), max_size=count + 1))
        if draw(st.booleans()):
            present = list(range(count))
        members += [(f"/d/s{k}_{i}", ShardSet(f"id{k}", i, count, "train")) for i in present]
    members += [(f"/d/x{j}", None) for j in range(draw(st.integers(0, 2)))]
    order = draw(st.permutations(range(len(members))))
    return [members[i] for i in order], draw(st.sampled_from(["prefix", "directory", "glob", "manifest"]))


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(selections())
def test_the_whole_set_rule_matches_its_model(case):
    members, selected_by = case
    want = model_verdict(members, selected_by)
    if want is None:
        require_whole_sets(members, source="/d", selected_by=selected_by)
        return
    with pytest.raises(ShardSetError) as info:
        require_whole_sets(members, source="/d", selected_by=selected_by)
    text = str(info.value)
    assert info.value.path == "/d" and info.value.field.startswith("set")
    if want == "several":
        assert "more than one set" in text
    if want == "incomplete":
        assert "is incomplete" in text and "missing" in text
    if want == "twice":
        assert "more than once" in text


def test_the_messages_name_sets_counts_and_shards():
    new = [(f"/d/ds_train_{i:06d}", ShardSet("9" * 32, i, 20, "train")) for i in range(8)]
    old = [(f"/d/ds_train_{i:06d}", ShardSet("1" * 32, i, 20, "train")) for i in range(8, 20)]
    with pytest.raises(ShardSetError) as info:
        require_whole_sets(new + old, source="/d", selected_by="directory")
    text = str(info.value)
    assert "set 111111111111 (train): 12 of its 20 shards (ds_train_000008" in text
    assert "set 999999999999 (train): 8 of its 20 shards (ds_train_000000, ds_train_000001, ds_train_000002 " \
           "and 5 more)" in text
    assert "--resume" in text and "manifest" in text
    with pytest.raises(ShardSetError, match=r"8 of its 20 shards .* is incomplete: shards 8-19 of the set are "
                                            r"missing"):
        require_whole_sets(new, source="/d", selected_by="manifest")
    with pytest.raises(ShardSetError, match="disagree about the set"):
        require_whole_sets(new + [("/d/odd", ShardSet("9" * 32, 8, 21, "train"))], source="/d", selected_by="glob")


# --------------------------------------------------------------------------- agreement, in words


DIFFERENCES = {  # field -> (first identity's changes, second's, words the message must hold)
    "tokenizer": ({"tokenizer": LLAMA}, {"tokenizer": DEEPSEEK},
                  "different tokenizers: 'meta-llama/Llama-3.1-8B-Instruct' (files sha256 aaaaaaaaaaaa) and "
                  "'deepseek-ai/DeepSeek-V3' (files sha256 dddddddddddd)"),
    "chat_template": ({"tokenizer": LLAMA}, {"tokenizer": dict(LLAMA, chat_template_sha256="f" * 64)},
                      "the same tokenizer ('meta-llama/Llama-3.1-8B-Instruct') with different chat templates "
                      "(sha256 cccccccccccc and ffffffffffff)"),
    "vocab_size": ({"vocab_size": 128256}, {"vocab_size": 129280},
                   "different vocabularies: 128,256 and 129,280 token ids"),
    "pad_seq_to_mult": ({"pad_seq_to_mult": 2}, {"pad_seq_to_mult": 4},
                        "sequences padded to different multiples: 2 and 4 tokens"),
    "pad_layout": ({"pad_seq_to_mult": 4, "pad_layout": "stored"}, {"pad_seq_to_mult": 4, "pad_layout": "runtime"},
                   "padded in Megatron-LM's 'stored' layout and in Megatron-Bridge's 'runtime' layout"),
    "parallelism": ({"pad_seq_to_mult": 4, "parallelism": {"cp": 2, "tp": 1, "sp": False}},
                    {"pad_seq_to_mult": 4, "parallelism": {"cp": 1, "tp": 2, "sp": True}},
                    "padded for different parallelism: CP 2, TP 1 and CP 1, TP 2, SP"),
}


@pytest.mark.parametrize("field", sorted(DIFFERENCES))
def test_each_difference_is_named_in_words(field):
    left, right, words = DIFFERENCES[field]
    with pytest.raises(IncompatibleShardsError) as info:
        require_compatible([("/d/a", identity(**left)), ("/d/b", identity(**right))])
    err = info.value
    assert err.field == field and err.path == "/d/b" and "/d/a" in str(err) and words in str(err), str(err)
    assert err.hint
    require_compatible([("/d/a", identity(**left)), ("/d/b", identity(**left))])


def test_readers_widen_dtypes_merge_does_not():
    pair = [("/d/a", identity()), ("/d/b", identity(token_dtype="int32"))]
    require_compatible(pair)
    with pytest.raises(IncompatibleShardsError, match="tokens stored as uint16 and as int32") as info:
        require_compatible(pair, widen=False, doing="merged")
    assert info.value.field == "token_dtype" and "--widen" in str(info.value)


def test_a_shard_without_a_tokenizer_does_not_hide_a_difference():
    """Each field is compared with the first shard that records it."""
    shards = [("/d/a", identity(tokenizer=LLAMA, vocab_size=None)), ("/d/b", identity(vocab_size=None)),
              ("/d/c", identity(tokenizer=DEEPSEEK, vocab_size=None))]
    with pytest.raises(IncompatibleShardsError, match="cannot be read together with /d/a") as info:
        require_compatible(shards)
    assert info.value.path == "/d/c" and info.value.field == "tokenizer"
    shards = [("/d/a", identity(vocab_size=None)), ("/d/b", identity(vocab_size=32000)),
              ("/d/c", identity(vocab_size=None)), ("/d/d", identity(vocab_size=32768))]
    with pytest.raises(IncompatibleShardsError, match="with /d/b: different vocabularies"):
        require_compatible(shards)


def test_one_recorded_tokenizer_makes_vocab_size_a_bound():
    """Same tokenizer, different vocab_size (a bound on the ids): agree. Without a common
    tokenizer a different vocabulary means different token spaces: refused."""
    require_compatible([("/d/a", identity(tokenizer=LLAMA, vocab_size=128256)),
                        ("/d/b", identity(tokenizer=dict(LLAMA, path="/elsewhere"), vocab_size=128512))])
    with pytest.raises(IncompatibleShardsError, match="different vocabularies"):
        require_compatible([("/d/a", identity(tokenizer=LLAMA, vocab_size=128256)),
                            ("/d/b", identity(vocab_size=128512))])


# --------------------------------------------------------------------------- identities in manifests


def test_identity_round_trips_and_is_parsed_strictly():
    ident = identity(tokenizer=LLAMA, parallelism={"cp": 2}, pad_seq_to_mult=4,
                     shard_set=ShardSet("x" * 32, 2, 5, "valid"))
    assert ShardIdentity.from_dict(json.loads(json.dumps(ident.to_dict()))) == ident
    for key, bad in [("token_dtype", "float32"), ("vocab_size", 0), ("vocab_size", True), ("vocab_size", 2 ** 31),
                     ("loss_mask_convention", "token_aligned"), ("pad_seq_to_mult", 0), ("pad_layout", "both"),
                     ("parallelism", []), ("tokenizer", "llama"), ("set", {"id": "x", "index": 5, "count": 5}),
                     ("set", {"id": "", "index": 0, "count": 1}), ("kind", "rl")]:
        raw = dict(ident.to_dict(), **{key: bad})
        with pytest.raises(MetadataError) as info:
            ShardIdentity.from_dict(raw, "/m.json", "shards[3].identity")
        assert info.value.field.startswith(f"shards[3].identity.{key}") and info.value.path == "/m.json", key
        raw.pop(key)
        with pytest.raises(MetadataError, match="missing"):
            ShardIdentity.from_dict(raw, "/m.json")


# --------------------------------------------------------------------------- every reader, on real shards


def _merge(tmp):
    from megatron_sft_idx.tools.merge import merge_shards
    return lambda spec: merge_shards(str(tmp / "merged"), [spec])


def _inspect(_tmp):
    from megatron_sft_idx.tools.merge_plan import resolve_inputs
    return lambda spec: resolve_inputs([spec])  # inspect-idx's summary, --pack and --sql all resolve so


def _sql(_tmp):
    from megatron_sft_idx.tools.arrow import PackTable
    return PackTable


def _bridge(_tmp):
    from megatron_sft_idx.training.bridge import PackedSFTDataset
    return PackedSFTDataset


READERS = {
    "open_packed": lambda tmp: open_packed,
    "MultiShardDataset.open": lambda tmp: MultiShardDataset.open,
    "write_manifest": lambda tmp: (lambda spec: write_manifest(str(tmp / "m.json"), spec)),
    "merge-shards": _merge,
    "inspect-idx": _inspect,
    "sql": _sql,
    "PackedSFTDataset": _bridge,
}


def _situation(tmp, kind):
    """A directory of real shards in one of the situations a set reader must refuse."""
    d = tmp / kind
    if kind == "incomplete":      # a publish stopped after 3 of 5 shards
        for i in range(3):
            member(d / f"ds_{i:06d}", "n" * 32, i, 5)
    elif kind == "generations":   # 3 new shards over the 2 last of an old set of 5
        for i in range(3):
            member(d / f"ds_{i:06d}", "n" * 32, i, 5, seed=1)
        for i in range(3, 5):
            member(d / f"ds_{i:06d}", "o" * 32, i, 5, seed=2)
    elif kind == "two_sets":      # train and valid of one run, each whole
        for i in range(2):
            member(d / f"ds_train_{i:06d}", "t" * 32, i, 2, name="train")
        member(d / "ds_valid_000000", "v" * 32, 0, 1, name="valid")
    elif kind == "stranger":      # a whole set and a shard of no set
        for i in range(2):
            member(d / f"ds_{i:06d}", "n" * 32, i, 2)
        member(d / "other", None, 0, 1, seed=3)
    return d


EXPECT = {"incomplete": "set nnnnnnnnnnnn (train): 3 of its 5 shards (ds_000000, ds_000001, ds_000002) is "
                        "incomplete: shards 3-4 of the set are missing",
          "generations": "set nnnnnnnnnnnn (train): 3 of its 5 shards (ds_000000, ds_000001, ds_000002); "
                         "set oooooooooooo (train): 2 of its 5 shards (ds_000003, ds_000004)",
          "two_sets": "set tttttttttttt (train): 2 of its 2 shards (ds_train_000000, ds_train_000001); "
                      "set vvvvvvvvvvvv (valid): 1 of its 1 shards (ds_valid_000000)",
          "stranger": "set nnnnnnnnnnnn (train): 2 of its 2 shards (ds_000000, ds_000001); 1 shard of no set (other)"}


@pytest.mark.parametrize("kind", sorted(EXPECT))
@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_reader_refuses_what_is_not_one_whole_set(tmp_path, reader, kind):
    d = _situation(tmp_path, kind)
    read = READERS[reader](tmp_path)
    for spec in (str(d), str(d / "*")):
        with pytest.raises(ShardSetError) as info:
            read(spec)
        assert EXPECT[kind] in str(info.value), str(info.value)
        assert info.value.path == spec and "\n" not in str(info.value)
    assert not os.path.exists(tmp_path / "merged.idx") and not os.path.exists(tmp_path / "m.json")


def test_what_a_reader_may_read_of_a_set(tmp_path):
    """A whole set by directory, glob or manifest; one set of a directory of two by its glob;
    any member by its prefix; part of a set by listing prefixes one by one."""
    d = _situation(tmp_path, "two_sets")
    assert len(open_packed(str(d / "ds_train_*"))) == 8 and len(open_packed(str(d / "ds_valid*"))) == 4
    assert len(open_packed(str(d / "ds_train_000001"))) == 4
    assert len(open_packed([str(d / "ds_train_000001"), str(d / "ds_valid_000000")])) == 8
    write_manifest(str(tmp_path / "train.json"), str(d / "ds_train_*"))
    write_manifest(str(tmp_path / "both.json"), [str(d / "ds_train_*"), str(d / "ds_valid_*")])  # two whole sets
    assert len(open_packed(str(tmp_path / "both.json"))) == 12
    partial = _situation(tmp_path, "incomplete")
    assert len(open_packed([str(partial / f"ds_{i:06d}") for i in range(3)])) == 12
    with pytest.raises(ShardSetError, match="incomplete"):
        write_manifest(str(tmp_path / "part.json"), [str(partial / f"ds_{i:06d}") for i in range(3)])


def test_shards_without_a_set_read_as_before(tmp_path):
    for i in range(3):
        member(tmp_path / "old" / f"part_{i}", None, 0, 1, seed=i)
    assert open_packed(str(tmp_path / "old")).num_shards == 3


def test_a_manifest_listing_part_of_a_set_is_refused_at_open(tmp_path):
    d = _situation(tmp_path, "two_sets")
    manifest = tmp_path / "train.json"
    write_manifest(str(manifest), str(d / "ds_train_*"))
    obj = json.loads(manifest.read_text())
    obj["shards"].pop()
    manifest.write_text(json.dumps(obj))
    with pytest.raises(ShardSetError, match=r"1 of its 2 shards .* is incomplete") as info:
        open_packed(str(manifest))
    assert info.value.path == str(manifest)


def test_a_shard_replaced_after_its_manifest_is_refused_when_opened(tmp_path):
    d = _situation(tmp_path, "two_sets")
    manifest = str(tmp_path / "train.json")
    write_manifest(manifest, str(d / "ds_train_*"))
    ds = open_packed(manifest)
    member(d / "ds_train_000001", "z" * 32, 1, 2, seed=9, overwrite=True)  # another generation, same pack count
    ds[0]
    with pytest.raises(ShardSetError, match="not the one .*train.json lists .*set zzzzzzzzzzzz") as info:
        ds[5]
    assert info.value.path == str(d / "ds_train_000001")


def test_readers_refuse_shards_that_disagree(tmp_path):
    member(tmp_path / "mix" / "a", None, 0, 1, tokenizer=LLAMA)
    member(tmp_path / "mix" / "b", None, 0, 1, tokenizer=DEEPSEEK)
    for spec in (str(tmp_path / "mix"), [str(tmp_path / "mix" / "a"), str(tmp_path / "mix" / "b")]):
        with pytest.raises(IncompatibleShardsError, match="different tokenizers: 'meta-llama") as info:
            open_packed(spec)
        assert info.value.field == "tokenizer"
    with pytest.raises(IncompatibleShardsError, match="different tokenizers"):
        write_manifest(str(tmp_path / "m.json"), str(tmp_path / "mix"))
    # a manifest edited to list both is refused when read, before any shard is opened
    write_manifest(str(tmp_path / "a.json"), str(tmp_path / "mix" / "a"))
    write_manifest(str(tmp_path / "b.json"), str(tmp_path / "mix" / "b"))
    both = json.loads((tmp_path / "a.json").read_text())
    both["shards"] += json.loads((tmp_path / "b.json").read_text())["shards"]
    (tmp_path / "both.json").write_text(json.dumps(both))
    with pytest.raises(IncompatibleShardsError, match="different tokenizers"):
        open_packed(str(tmp_path / "both.json"))


def test_bridge_splits_must_agree(tmp_path):
    from types import SimpleNamespace

    from megatron_sft_idx.training.bridge import bridge_datasets

    a = member(tmp_path / "a", None, 0, 1, tokenizer=LLAMA)
    b = member(tmp_path / "b", None, 0, 1, tokenizer=DEEPSEEK)
    ctx = SimpleNamespace(train_samples=8, valid_samples=4, test_samples=0, tokenizer=None)
    train, valid, _ = bridge_datasets(ctx, train=a, valid=a)
    assert len(train) == 8 and len(valid) == 4
    with pytest.raises(IncompatibleShardsError, match="used with the other splits") as info:
        bridge_datasets(ctx, train=a, valid=b)
    assert info.value.path == b


def test_inspect_cli_refuses_in_one_line(tmp_path, capsys):
    from megatron_sft_idx.tools.inspect_cli import main as inspect_main

    d = _situation(tmp_path, "generations")
    for extra in ([], ["--sql", "SELECT count(*) FROM packs"], ["--pack", "0"]):
        assert inspect_main([str(d), *extra]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "more than one set" in err and "Traceback" not in err


# --------------------------------------------------------------------------- sets written by preprocess-sft


@pytest.fixture(scope="module")
def generations(tmp_path_factory):
    """Two generations of one multi-shard output (seed 1 and seed 2) and a single-shard output."""
    from support.stages import preprocess

    d = tmp_path_factory.mktemp("gens")
    kw = dict(pack_size=512, split=[90, 10], max_packs_per_shard=12)
    preprocess(str(d / "one"), seed=1, **kw)
    preprocess(str(d / "one_again"), seed=1, workers=2, partition_bytes=50_000, **kw)
    preprocess(str(d / "two"), seed=2, **kw)
    preprocess(str(d / "single"), pack_size=512)
    return d


def _sets(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".seq.idx"):
            m = MMapIndexedDataset(os.path.join(directory, name[: -len(".seq.idx")])).metadata
            out[name[: -len(".seq.idx")]] = m.shard_set
    return out


def test_preprocess_writes_each_split_as_a_set(generations):
    one, again, two = _sets(generations / "one"), _sets(generations / "one_again"), _sets(generations / "two")
    train = {k: s for k, s in one.items() if "_train_" in k}
    valid = {k: s for k, s in one.items() if "_valid_" in k}
    assert len(train) > 2 and valid
    assert sorted(s.index for s in train.values()) == list(range(len(train)))
    assert {(s.id, s.count, s.name) for s in train.values()} == {(next(iter(train.values())).id, len(train), "train")}
    assert {s.name for s in valid.values()} == {"valid"} and {s.id for s in valid.values()}.isdisjoint(
        {s.id for s in train.values()})
    assert one == again  # deterministic: the same inputs and settings, other workers and partitions
    assert {s.id for s in one.values()}.isdisjoint({s.id for s in two.values()})  # another seed, another set
    single = _sets(generations / "single")
    assert list(single.values()) == [None]  # one shard: no set, bytes as before


def test_a_directory_of_two_generations_is_refused_and_its_manifest_still_reads(generations, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(generations / "one", mixed)
    new = sorted(n[:-4] for n in os.listdir(generations / "two") if n.startswith("ds_train_") and n.endswith(".idx")
                 and not n.endswith(".seq.idx"))[:2]
    for prefix in new:  # the first shards of the new generation over the old ones (a copy cut short)
        for suffix in ALL_SUFFIXES:
            shutil.copyfile(generations / "two" / (prefix + suffix), mixed / (prefix + suffix))
    os.remove(mixed / "ds_train.json")
    old_id = _sets(generations / "one")["ds_train_000000"].id
    new_id = _sets(generations / "two")["ds_train_000000"].id
    for spec in (str(mixed), str(mixed / "ds_train_*")):
        with pytest.raises(ShardSetError) as info:
            open_packed(spec)
        text = str(info.value)
        assert f"set {new_id[:12]} (train): 2 of its" in text and f"set {old_id[:12]} (train): " in text
    assert len(open_packed(str(generations / "one" / "ds_train.json"))) > 0
    with pytest.raises(ShardError):
        open_packed(str(mixed))


def test_merge_of_a_whole_set_is_one_shard_of_no_set(generations, tmp_path):
    from megatron_sft_idx.tools.merge import merge_shards

    result = merge_shards(str(tmp_path / "all"), [str(generations / "one" / "ds_train.json")])
    assert result.metadata.shard_set is None
    assert len(MMapIndexedDataset(str(tmp_path / "all"))) == len(open_packed(str(generations / "one" /
                                                                                  "ds_train.json")))


# --------------------------------------------------------------------------- in object storage


def test_remote_directories_globs_and_manifests_follow_the_same_rules(s3, bucket, tmp_path):
    from megatron_sft_idx.publishing import publish, upload_shard
    from megatron_sft_idx.tools.merge import merge_shards

    whole = _situation(tmp_path, "two_sets")
    published = publish([str(whole / f"ds_train_{i:06d}") for i in range(2)], f"s3://{bucket}/whole",
                        manifest="ds_train.json")
    assert len(open_packed(f"s3://{bucket}/whole/ds_train.json")) == 8
    assert len(open_packed(f"s3://{bucket}/whole/")) == 8 and len(open_packed(published)) == 8
    mixed = _situation(tmp_path, "generations")
    for i in range(5):
        upload_shard(str(mixed / f"ds_{i:06d}"), f"s3://{bucket}/mixed/ds_{i:06d}")
    for spec in (f"s3://{bucket}/mixed/", f"s3://{bucket}/mixed", f"s3://{bucket}/mixed/ds_*"):
        for read in (open_packed, lambda s: merge_shards(str(tmp_path / "merged"), [s])):
            with pytest.raises(ShardSetError) as info:
                read(spec)
            assert EXPECT["generations"] in str(info.value) and info.value.path == spec
    assert len(open_packed(f"s3://{bucket}/mixed/ds_000003")) == 4  # a member named by its prefix
    # a remote manifest that lists part of the set (edited): refused when read, naming the URL
    manifest = json.loads(s3.client().get_object(Bucket=bucket, Key="whole/ds_train.json")["Body"].read())
    manifest["shards"].pop()
    s3.client().put_object(Bucket=bucket, Key="whole/part.json", Body=json.dumps(manifest).encode())
    with pytest.raises(ShardSetError, match="incomplete") as info:
        open_packed(f"s3://{bucket}/whole/part.json")
    assert info.value.path == f"s3://{bucket}/whole/part.json"
