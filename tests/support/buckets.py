"""What the bucket tests (tests/preprocess/test_bucket_store.py, test_bucket_ray.py,
test_preprocess_remote.py) compare: a run's files on local disk and the objects under a bucket
prefix, each as ``{name: bytes}``, and the reference run on local disk they are compared with."""

import os

from megatron_sft_idx.preprocess.cli import main as preprocess_main


def local_files(directory):
    """{name: bytes} of the files a run published in ``directory`` (not its hidden record)."""
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))
            if not n.startswith(".")}


def bucket_files(s3, bucket, prefix, hidden=False):
    """{key after ``prefix``: bytes} of the objects under ``prefix``; hidden ones (a work directory) with ``hidden``."""
    client = s3.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]
    return {k[len(prefix):]: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in sorted(keys)
            if hidden or not k[len(prefix):].startswith(".")}


def local_reference(tmp_path_factory, settings):
    """The reference: preprocess-sft ``settings`` on local disk (``<root>/out``, store ``<root>/store``); the root."""
    root = tmp_path_factory.mktemp("local")
    assert preprocess_main(settings + ["--output-prefix", str(root / "out" / "ds"), "--store", str(root / "store")]) == 0
    return root
