"""``--engine ray`` against a REAL Ray cluster on 127.0.0.1 (one per module, 2 CPUs), never a mock.

The cluster is started by this module with ``ray.init`` (or joined, when ``RAY_ADDRESS`` is set
in the environment: an existing cluster is joined, never replaced). Every run through Ray must
give the bytes the local engine gives.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

from megatron_sft_idx.preprocess import Config, RepackConfig, repack, run  # noqa: E402
from support.stages import files_of, preprocess  # noqa: E402  (the local engine's helpers, shared)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
TOKENIZER = os.path.join(EXAMPLES, "tokenizer")
CHAT = [os.path.join(EXAMPLES, "conversations.jsonl"), os.path.join(EXAMPLES, "conversations_sharegpt.jsonl")]


@pytest.fixture(scope="module")
def cluster():
    joined = bool(os.environ.get("RAY_ADDRESS"))
    if joined:
        ray.init(address=os.environ["RAY_ADDRESS"])
    else:
        ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
                 runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()  # disconnects from a joined cluster; stops only a cluster started here



def test_ray_engine_gives_the_bytes_of_the_local_engine(cluster, tmp_path):
    kw = dict(split=[90, 10], max_packs_per_shard=9, cp=2, partition_bytes=50_000, verify_masks=10, check=True)
    s = preprocess(str(tmp_path / "ray"), engine="ray", store=str(tmp_path / "store"), **kw)
    assert s["engine"]["kind"] == "ray" and s["engine"]["address"] == cluster and not s["engine"]["started_here"]
    preprocess(str(tmp_path / "local"), workers=2, **kw)
    ray_files = files_of(tmp_path / "ray")
    assert len(ray_files) > 10 and ray_files == files_of(tmp_path / "local")
    # repack on the cluster from the store it wrote: the bytes of a fresh local run
    again = repack(RepackConfig(store=str(tmp_path / "store"), output_prefix=str(tmp_path / "rp" / "ds"),
                                pack_size=2048, cp=4, engine="ray", progress=False))
    assert again["engine"]["kind"] == "ray"
    preprocess(str(tmp_path / "fresh"), pack_size=2048, cp=4)
    assert files_of(tmp_path / "rp") == files_of(tmp_path / "fresh")


def test_ray_errors_name_the_record_and_publish_nothing(cluster, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(open(CHAT[0]).read() + '{"messages": [\n')
    with pytest.raises(Exception) as e:
        run(Config(inputs=[str(bad)], output_prefix=str(tmp_path / "o" / "ds"), tokenizer=TOKENIZER,
                   engine="ray", partition_bytes=40_000, progress=False))
    assert f"{bad}:401: malformed JSON" in str(e.value) and type(e.value).__name__ == "InputError"
    assert not [n for n in os.listdir(tmp_path / "o") if not n.startswith(".")]


def test_a_driver_joins_the_cluster_in_RAY_ADDRESS(cluster, tmp_path):
    """A separate driver process with RAY_ADDRESS set runs on this cluster (not a new one)."""
    env = dict(os.environ, RAY_ADDRESS=cluster, PYTHONPATH=ROOT)
    out = tmp_path / "sub"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_sft.py"), "--input", *CHAT,
                           "--tokenizer", TOKENIZER, "--output-prefix", str(out / "ds"), "--pack-size", "1024",
                           "--engine", "ray", "--json", "--quiet"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout)
    assert s["engine"] == {"kind": "ray", "address": cluster, "started_here": False,
                           "cpus": int(ray.cluster_resources()["CPU"])}
    preprocess(str(tmp_path / "local"))
    assert files_of(out) == files_of(tmp_path / "local")
