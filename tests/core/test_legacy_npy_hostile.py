"""Hostile legacy ``.npy`` pickles are refused with a ShardError at bounded memory (issue 9, item 5).

Each case runs in a child process whose address space is capped at its size after imports
plus 1 GiB, and whose peak RSS may grow by at most 96 MiB while ``open_packed`` refuses
the file: declared lengths, declared array shapes and shared references must all be
checked against the bytes the file actually holds before anything is allocated.
"""

import json
import pickle
import struct
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.subprocess

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy 1.x
    from numpy.core.multiarray import _reconstruct

CHILD = r"""
import json, resource, sys
from megatron_sft_idx import open_packed
from megatron_sft_idx.errors import ShardError
def status(key):   # (VmHWM, not ru_maxrss: that keeps the forking pytest worker's size from before exec)
    return int([l for l in open("/proc/self/status") if l.startswith(key)][0].split()[1]) * 1024
open_packed(sys.argv[2])   # a legit file first: what opening loads once (numba, its kernels) is not growth
resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + (1 << 30), resource.RLIM_INFINITY))
before = status("VmHWM")
try:
    open_packed(sys.argv[1])
    outcome = "loaded"
except ShardError as exc:
    outcome = "ShardError: " + str(exc)[:300]
except BaseException as exc:
    outcome = f"{type(exc).__name__}: {str(exc)[:300]}"
grown = (status("VmHWM") - before) >> 20
print(json.dumps({"outcome": outcome, "grown_mib": grown}))
"""


class _Reduce:
    def __init__(self, *reduced):
        self.reduced = reduced

    def __reduce__(self):
        return self.reduced


def _npy(path, payload: bytes, shape=(1,)):
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "|O", "fortran_order": False, "shape": shape})
        f.write(payload)


def _object_array(items):
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr


def _cases():
    ids = list(range(100_000))
    shared = {"input_ids": ids, "loss_mask": [0] * 100_000, "seq_start_id": [0]}
    return {
        # numpy's _reconstruct asked for a gigabyte (numpy's own pickles pass shape (0,))
        "reconstruct_shape": pickle.dumps(_Reduce(_reconstruct, (np.ndarray, (1 << 30,), b"b")), protocol=3),
        # an array state declaring 2**30 objects / bytes while holding one
        "state_objects": pickle.dumps(_Reduce(_reconstruct, (np.ndarray, (0,), b"b"),
                                              (1, (1 << 30,), np.dtype(object), False, [1])), protocol=3),
        "state_bytes": pickle.dumps(_Reduce(_reconstruct, (np.ndarray, (0,), b"b"),
                                            (1, (1 << 30,), np.dtype(np.uint8), False, b"x")), protocol=3),
        "state_many_dims": pickle.dumps(_Reduce(_reconstruct, (np.ndarray, (0,), b"b"),
                                                (1, (1 << 20,) * 3, np.dtype(np.uint8), False, b"")), protocol=3),
        # huge declared lengths of the pickle opcodes themselves
        "binbytes8": b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"abc.",
        "binunicode8": b"\x80\x04\x8d" + struct.pack("<Q", 1 << 40) + b"abc.",
        "bytearray8": b"\x80\x05\x96" + struct.pack("<Q", 1 << 40) + b"abc.",
        "frame": b"\x80\x04\x95" + struct.pack("<Q", 1 << 40) + b"N.",
        "binbytes": b"\x80\x03B" + struct.pack("<I", (1 << 32) - 1) + b"abc.",
        # a big int where a token id belongs
        "big_int": pickle.dumps(_object_array([{"input_ids": [1 << 400_000], "loss_mask": [0],
                                                "seq_start_id": [0]}]), protocol=3),
        # deep nesting
        "deep_lists": b"\x80\x04" + b"]" * 200_001 + b"a" * 200_000 + b".",
        "deep_in_pack": pickle.dumps(_object_array([{"input_ids": [[[[[[1]]]]]], "loss_mask": [0],
                                                    "seq_start_id": [0]}]), protocol=3),
        # one pack's lists referenced by 20,000 packs: a small file that expands to ~30 GB
        "shared_refs": pickle.dumps(_object_array([shared] * 20_000), protocol=3),
        # a nested list referenced many times inside one field
        "shared_nested": pickle.dumps(_object_array([{"input_ids": [ids] * 50_000, "loss_mask": [0],
                                                      "seq_start_id": [0]}]), protocol=3),
    }


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_pickle_is_refused_at_bounded_memory(tmp_path, name):
    payload = CASES[name]
    shape = (20_000,) if name == "shared_refs" else (1,)
    path = str(tmp_path / f"{name}.npy")
    _npy(path, payload, shape)
    assert len(payload) < 2_000_000
    legit = str(tmp_path / "legit.npy")
    np.save(legit, _object_array([{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "seq_start_id": [0]}]),
            allow_pickle=True)
    proc = subprocess.run([sys.executable, "-c", CHILD, path, legit], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["outcome"].startswith("ShardError: "), result
    assert "MemoryError" not in result["outcome"], result  # refused before allocating, not by the cap
    assert result["grown_mib"] < 96, result


def test_a_legit_bridge_pickle_still_loads(tmp_path):
    from megatron_sft_idx.legacy import load_legacy_npy

    packs = [{"input_ids": list(range(1, 9)), "loss_mask": [0, 1, 1, 1, 0, 1, 1, 1], "seq_start_id": [0, 4]},
             {"input_ids": np.arange(1, 6), "loss_mask": np.array([True, True, True, True, False]),
              "seq_start_id": np.array([0])}]
    path = str(tmp_path / "ok.npy")
    np.save(path, _object_array(packs), allow_pickle=True)
    src = load_legacy_npy(path)
    assert len(src) == 2 and src[0].loss_mask.tolist() == [0, 1, 1, 0, 0, 1, 1, 0]  # last positions: 0
    assert src[1].input_ids.tolist() == [1, 2, 3, 4, 5] and src[1].loss_mask.tolist() == [1, 1, 1, 1, 0]
