"""``--balance-for`` with an ``s3://`` output (the loopback S3 server of tests/conftest.py): the
orders are uploaded after every shard and before every manifest, byte for byte the local run's,
the manifests record them, and ``--resume`` of the finished run checks them and writes nothing."""

import json
import os

from megatron_sft_idx.batching import Order
from megatron_sft_idx.preprocess.cli import main as preprocess_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
SETTINGS = ["--input", os.path.join(EXAMPLES, "conversations.jsonl"), "--tokenizer", os.path.join(EXAMPLES, "tokenizer"),
            "--pack-size", "1024", "--max-packs-per-shard", "20", "--split", "80,10,10", "--quiet",
            "--balance-for", "2,1,4", "--cost-model", "llama3.2-1b"]


def test_orders_are_uploaded_after_the_shards_and_recorded_by_the_manifests(s3, bucket, tmp_path, capsys):
    local = tmp_path / "local"
    assert preprocess_main(SETTINGS + ["--output-prefix", str(local / "ds")]) == 0
    url = f"s3://{bucket}/bal/ds"
    s3.clear()
    args = SETTINGS + ["--output-prefix", url, "--staging-dir", str(tmp_path / "stage"), "--json"]
    assert preprocess_main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["orders"] == [f"{url}_{s}.order" for s in ("train", "valid", "test")]
    client = s3.client()
    for split in ("train", "valid", "test"):
        uploaded = client.get_object(Bucket=bucket, Key=f"bal/ds_{split}.order")["Body"].read()
        assert uploaded == open(local / f"ds_{split}.order", "rb").read()
        Order.from_bytes(uploaded)
        manifest = json.loads(client.get_object(Bucket=bucket, Key=f"bal/ds_{split}.json")["Body"].read())
        assert manifest["order"]["file"] == f"ds_{split}.order" and manifest["order"]["size"] == len(uploaded)
    puts = [k for m, k, _, _ in s3.requests if m == "PUT" and "/bal/" in k]
    orders = [i for i, k in enumerate(puts) if k.endswith(".order")]
    manifests = [i for i, k in enumerate(puts) if k.endswith(".json")]
    shards = [i for i, k in enumerate(puts) if not k.endswith((".order", ".json"))]
    assert len(orders) == 3 and max(shards) < min(orders) and max(orders) < min(manifests), puts
    s3.clear()
    assert preprocess_main(args + ["--resume"]) == 0
    assert json.loads(capsys.readouterr().out)["resumed_units"] == {"done": 1}
    assert not [r for r in s3.requests if r[0] in ("PUT", "DELETE")]
