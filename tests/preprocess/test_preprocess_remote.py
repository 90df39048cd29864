"""preprocess-sft and repack-sft with an s3:// / msc:// --output-prefix, against moto's S3 server on
loopback (the ``s3`` / ``bucket`` fixtures of tests/conftest.py): the run works in a local staging
directory, then uploads every shard data first and ``.idx`` last, the manifests last. The objects
are byte for byte the files of the same run written locally; a kill during the upload is finished
by --resume with the same objects, and no manifest is visible while the set is partial."""

import json
import os

import numpy as np
import pytest

from megatron_sft_idx.preprocess.cli import main as preprocess_main
from megatron_sft_idx.multi import MultiShardDataset
from megatron_sft_idx.open import open_packed
from megatron_sft_idx.preprocess.repack_cli import repack_main

# (bucket_files(..., hidden=True): the run's record stays in the staging directory, nothing hidden
# may reach the bucket)
from support.buckets import bucket_files, local_files, local_reference
from support.faults import run_leftovers
from support.stages import kill_at_call, killed_driver, run_killed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
# Several shards per split (20 packs each), three splits: 5 shards, 3 manifests.
SETTINGS = ["--input", os.path.join(EXAMPLES, "conversations.jsonl"), "--tokenizer", os.path.join(EXAMPLES, "tokenizer"),
            "--pack-size", "1024", "--max-packs-per-shard", "20", "--split", "80,10,10", "--quiet"]
SHARDS = 5


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The reference: the same run written to local disk (keeping its store, for repack-sft)."""
    return local_reference(tmp_path_factory, SETTINGS)


def only_records(stage) -> bool:
    """Whether the staging directory holds nothing but finished runs' records (one per URL)."""
    return all(os.listdir(stage / d) and run_leftovers(stage / d) == []
               and not [n for n in os.listdir(stage / d) if not n.startswith(".")] for d in os.listdir(stage))


def writes(s3):
    """Keys of the requests that changed the bucket, in order: ("PUT"|"DELETE", key)."""
    return [(m, k) for m, k, _, _ in s3.requests if m in ("PUT", "DELETE") or (m == "POST" and "?" not in k)]


def assert_publish_order(s3, prefix):
    """Each shard's .idx after its data; every manifest after every shard."""
    puts = [k for m, k in writes(s3) if m == "PUT" and prefix in k]
    idx = [i for i, k in enumerate(puts) if k.endswith(".idx") and not k.endswith(".seq.idx")]
    manifests = [i for i, k in enumerate(puts) if k.endswith(".json")]
    assert len(idx) == SHARDS and len(manifests) == 3, puts
    assert min(manifests) > max(i for i, k in enumerate(puts) if not k.endswith(".json")), puts
    for i in idx:
        shard = puts[i][: -len(".idx")]
        assert all(j < i for j, k in enumerate(puts) if k.startswith(shard + ".") and j != i), puts


def same_packs(a, b) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.loss_mask, y.loss_mask)
        and np.array_equal(x.seq_start_id, y.seq_start_id) for x, y in zip(a.get_many(range(len(a))),
                                                                               b.get_many(range(len(b)))))


def test_preprocess_to_s3_uploads_the_local_run(s3, bucket, local_run, tmp_path, capsys):
    url = f"s3://{bucket}/sft/ds"
    s3.clear()
    assert preprocess_main(SETTINGS + ["--output-prefix", url, "--staging-dir", str(tmp_path / "stage"),
                                       "--json", "--check"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["outputs"][0] == url + "_train_000000" and summary["manifests"][0] == url + "_train.json"
    assert bucket_files(s3, bucket, "sft/", hidden=True) == local_files(local_run / "out")  # byte for byte, manifests too
    assert_publish_order(s3, "/sft/ds")
    assert only_records(tmp_path / "stage")  # the staged copies are gone: only the run's record stays
    # Read back from the bucket, pack for pack, through each reader of a set.
    for split in ("train", "valid", "test"):
        here = open_packed(str(local_run / "out" / f"ds_{split}.json"))
        assert same_packs(open_packed(f"{url}_{split}.json"), here), split
        assert same_packs(MultiShardDataset.open(f"{url}_{split}.json"), here), split
    assert same_packs(open_packed(f"{url}_train_000001"), open_packed(str(local_run / "out" / "ds_train_000001")))


def test_resume_of_a_finished_upload_is_a_no_op_until_an_object_changes(s3, bucket, local_run, tmp_path, capsys):
    """The run's record (in the staging directory) lists every object's size: --resume of the
    finished run lists the prefix once and writes nothing; an object gone or resized since makes
    the run upload again."""
    url = f"s3://{bucket}/sft/ds"
    args = SETTINGS + ["--output-prefix", url, "--staging-dir", str(tmp_path / "stage"), "--json"]
    assert preprocess_main(args) == 0
    capsys.readouterr()
    s3.clear()
    assert preprocess_main(args + ["--resume"]) == 0
    assert json.loads(capsys.readouterr().out)["resumed_units"] == {"done": 1} and writes(s3) == []
    s3.client().delete_object(Bucket=bucket, Key="sft/ds_valid_000000.bin")
    assert preprocess_main(args + ["--resume"]) == 0
    assert json.loads(capsys.readouterr().out)["resumed_units"] != {"done": 1}
    assert bucket_files(s3, bucket, "sft/", hidden=True) == local_files(local_run / "out")
    assert only_records(tmp_path / "stage")


def test_an_existing_output_is_refused_and_overwrite_replaces_it(s3, bucket, local_run, tmp_path, capsys):
    url = f"s3://{bucket}/sft/ds"
    stage = ["--staging-dir", str(tmp_path / "stage")]
    assert preprocess_main(SETTINGS + ["--output-prefix", url] + stage) == 0
    before = bucket_files(s3, bucket, "sft/", hidden=True)
    capsys.readouterr()
    s3.clear()
    assert preprocess_main(SETTINGS + ["--output-prefix", url] + stage) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"already exists ({len(before)} file(s), e.g. {url}_test.json)" in err, err
    assert "--overwrite" in err and writes(s3) == [] and bucket_files(s3, bucket, "sft/", hidden=True) == before
    # --overwrite with larger shards: a smaller set; the old set's extra shard is gone.
    s3.clear()
    assert preprocess_main(SETTINGS + ["--output-prefix", url, "--max-packs-per-shard", "60", "--overwrite"] + stage) == 0
    after = bucket_files(s3, bucket, "sft/", hidden=True)
    assert preprocess_main(SETTINGS + ["--output-prefix", str(tmp_path / "local" / "ds"), "--max-packs-per-shard", "60"]) == 0
    assert after == local_files(tmp_path / "local") and "ds_train_000001.bin" not in after
    deletes = [k for m, k in writes(s3) if m == "DELETE"]
    assert all(k.endswith(".json") for k in deletes[:3]), deletes  # the manifests first: no set visible
    index = [k.endswith(".idx") and not k.endswith(".seq.idx") for k in deletes[3:]]
    assert index == [True] * SHARDS + [False] * (len(index) - SHARDS), deletes  # then every old .idx, then data


@pytest.mark.parametrize("sig,n", [("SIGKILL", 8), ("SIGKILL", SHARDS * 5 + 2), ("SIGTERM", 8)])
def test_a_kill_during_the_upload_is_finished_by_resume(s3, bucket, local_run, tmp_path, capsys, sig, n):
    """SIGKILL before upload ``n`` (mid second shard; between the first and second manifest),
    or SIGTERM: no manifest is visible after the kill unless every shard is complete, and
    --resume uploads what is missing, giving the objects of an uninterrupted run."""
    url = f"s3://{bucket}/sft/ds"
    args = SETTINGS + ["--output-prefix", url, "--staging-dir", str(tmp_path / "stage")]
    proc = run_killed(killed_driver(args, kill_at_call("upload", n, sig)))
    if sig == "SIGKILL":
        assert proc.returncode == -9, proc.stderr
    else:  # the tool's own ending: one line, the work directory kept for --resume
        assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr
        assert "interrupted while publishing" in proc.stderr and "--resume" in proc.stderr, proc.stderr
    partial = bucket_files(s3, bucket, "sft/", hidden=True)
    manifests = [k for k in partial if k.endswith(".json")]
    idx = [k for k in partial if k.endswith(".idx") and not k.endswith(".seq.idx")]
    assert len(manifests) == (1 if n > SHARDS * 5 else 0) and len(idx) == (SHARDS if manifests else 1), partial
    for name in manifests:  # a visible manifest lists only complete shards
        assert len(open_packed(f"s3://{bucket}/sft/{name}")) > 0
    assert preprocess_main(args) == 1  # without --resume: the partial set is an existing output
    assert "already exists" in capsys.readouterr().err
    assert preprocess_main(args + ["--resume", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["resumed_units"]["publish"] == (SHARDS if manifests else 1)
    assert summary["resumed_units"]["materialize"] == SHARDS and summary["resumed_units"]["tokenize"] >= 1
    assert bucket_files(s3, bucket, "sft/", hidden=True) == local_files(local_run / "out")
    assert only_records(tmp_path / "stage")


def test_a_failing_upload_keeps_the_work_for_resume(s3, bucket, local_run, tmp_path, capsys):
    """PUTs of one .idx keep failing (HTTP 500 past every retry): one line naming the object and
    saying --resume finishes; nothing opens there, no manifest; --resume then finishes."""
    url = f"s3://{bucket}/sft/ds"
    args = SETTINGS + ["--output-prefix", url, "--staging-dir", str(tmp_path / "stage")]
    s3.inject("500", lambda m, k, h: m == "PUT" and k.endswith("/sft/ds_train_000001.idx"), times=100)
    assert preprocess_main(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{url}_train_000001: cannot upload the shard" in err, err
    assert "--resume" in err and "Traceback" not in err
    assert not [k for k in bucket_files(s3, bucket, "sft/", hidden=True) if k.endswith(".json")]
    s3.clear()
    assert preprocess_main(args + ["--resume"]) == 0
    assert bucket_files(s3, bucket, "sft/", hidden=True) == local_files(local_run / "out")


def test_repack_to_an_msc_profile(s3, bucket, local_run, tmp_path, monkeypatch):
    profile = "loop"  # as other modules name theirs, on other servers: clients follow MSC_CONFIG
    monkeypatch.setenv("MSC_CONFIG", s3.msc_config(str(tmp_path / "msc.json"), profile, bucket))
    args = [a for a in SETTINGS[4:]]  # the packing settings, without --input / --tokenizer
    assert repack_main(["--store", str(local_run / "store"), "--output-prefix", f"msc://{profile}/re/ds",
                        "--staging-dir", str(tmp_path / "stage")] + args) == 0
    assert bucket_files(s3, bucket, "re/", hidden=True) == local_files(local_run / "out")
    assert same_packs(open_packed(f"msc://{profile}/re/ds_train.json"), open_packed(str(local_run / "out" / "ds_train.json")))


@pytest.mark.parametrize("case", ["no bucket", "no credentials", "endpoint down", "no name"])
def test_an_unusable_destination_is_one_line_before_any_work(s3, bucket, tmp_path, monkeypatch, capsys, case):
    from bench.s3loop import reset_clients

    url = f"s3://{bucket}/sft/ds"
    if case == "no bucket":
        url = "s3://no-such-bucket-msi/sft/ds"
    elif case == "no credentials":
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(key)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    elif case == "endpoint down":
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        monkeypatch.setenv("MEGATRON_SFT_IDX_RETRIES", "2")
    else:
        url = f"s3://{bucket}/sft/"
    reset_clients()
    assert preprocess_main(SETTINGS + ["--output-prefix", url, "--staging-dir", str(tmp_path / "stage")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and url in err and "Traceback" not in err, err
    expected = {"no bucket": "does not exist", "no credentials": "credentials", "endpoint down": "AWS_ENDPOINT_URL",
                "no name": "must end in the shards' name"}[case]
    assert expected in err, err
    assert not (tmp_path / "stage").exists()  # refused before any work


def test_an_upload_the_store_lost_fails_the_run_and_resume_finishes_it(s3, bucket, local_run, tmp_path, capsys,
                                                                      monkeypatch):
    """The store acknowledges the train manifest's PUT but nothing lands: the read-back after the
    set's commit fails the run (exit 1, the object named, --resume said), and --resume finishes
    with the objects of a clean run."""
    from megatron_sft_idx.storage.destination import ObjectDestination

    real = ObjectDestination.write_bytes

    def lossy(self, path, data):
        if not path.endswith("ds_train.json"):
            real(self, path, data)

    monkeypatch.setattr(ObjectDestination, "write_bytes", lossy)
    url = f"s3://{bucket}/sft/ds"
    args = SETTINGS + ["--output-prefix", url, "--staging-dir", str(tmp_path / "stage")]
    assert preprocess_main(args) == 1
    err = capsys.readouterr().err
    assert "not whole" in err and f"{url}_train.json" in err and "--resume" in err, err
    monkeypatch.setattr(ObjectDestination, "write_bytes", real)
    assert preprocess_main(args + ["--resume"]) == 0
    assert bucket_files(s3, bucket, "sft/", hidden=True) == local_files(local_run / "out")
