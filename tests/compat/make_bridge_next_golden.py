#!/usr/bin/env python3
"""Regenerate tests/golden/bridge_next/ (or bridge_pr5610/): Megatron-Bridge's packed collate on the compat packs.

CI has no network, so the batches Bridge's next release builds are committed as data (never
Bridge's code). To regenerate, with Bridge's repository fetched (e.g. by the session's fetch
tool to /work/.mirror/NVIDIA-NeMo+Megatron-Bridge/repo) and the 0.6.2 stack installed
(``make install-compat``)::

    python3 tests/compat/make_bridge_next_golden.py --bridge-repo /path/to/Megatron-Bridge [--commit HEAD]

What it does:

1. builds a "next" stack in a temporary directory: the installed ``.deps/megatron-bridge-0.6.2``
   copied, its ``megatron/bridge/data/packing/gpt_sft.py`` (``GPTSFTPackedDataset``, whose
   ``collate_fn`` is the one that changed) replaced by the file at ``--commit`` of the repository
   (``git show``); every other module stays 0.6.2's;
2. runs itself in a subprocess with that stack first on PYTHONPATH: writes the compat packs with
   Bridge's own packer (``bridge_data.write_bridge_artifacts``, as the parity tests do), builds
   Bridge's readers (``build_gpt_sft_split`` over the ``.npy`` and over the Parquet) and records,
   for every cell (prompt/chat x CP 1/4 x padding options x answer_only_loss x source), the
   batches ``collate_fn`` returns for fixed index lists of sizes 1 and 3 (negative indices:
   Bridge's padding samples);
3. writes ``cells.json`` (the cells, their index lists, the non-tensor values, a SHA-256 of the
   packs each cell read, the Bridge commit, the ref it was asked for, the file and the file's
   SHA-256) and ``batches.npz`` (every tensor). Running it twice at one commit writes the same
   bytes.

``--compare DIR`` then prints, per key, how many batches differ from the fixture in ``DIR``
(same cells, same packs), split by ``pad_seq_to_mult``: what moving the fixture to another
Bridge commit would change. For example, the head of Bridge PR #5610 (``refs/pull/5610/head``
in the fetched mirror) against the committed fixture::

    python3 tests/compat/make_bridge_next_golden.py --bridge-repo /path/to/Megatron-Bridge \
        --commit refs/pull/5610/head --out /tmp/pr5610 --compare tests/golden/bridge_next

The second fixture, ``tests/golden/bridge_pr5610/``, was written by exactly that command with
``--out tests/golden/bridge_pr5610`` (commit ``8d95ff4c``; running it again writes the same bytes).

``tests/compat/test_bridge_next.py`` rebuilds the same packs with the installed 0.6.2 packer,
checks their digest, and compares ``PackedSFTDataset(bridge_semantics="next")`` with the first
fixture's batches and ``bridge_semantics="pr5610"`` with the second's, element by element.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))   # tests/, for support.upstream_git when run as a script
from support.upstream_git import files_at, git_command, overlaid_stack, resolve  # noqa: E402

GOLDEN = os.path.join(ROOT, "tests", "golden", "bridge_next")
#: The same cells at the head of Bridge PR #5610 (``--commit refs/pull/5610/head --out`` this).
GOLDEN_PR5610 = os.path.join(ROOT, "tests", "golden", "bridge_pr5610")
STACK = "megatron-bridge-0.6.2"
MODULE = "megatron/bridge/data/packing/gpt_sft.py"
UPSTREAM_PATH = "src/" + MODULE
OPTION_SETS = {"dyn": dict(pad_to_max_length=False, pad_cu_seqlens=False),
               "max": dict(pad_to_max_length=True, pad_cu_seqlens=False),
               "max+cu": dict(pad_to_max_length=True, pad_cu_seqlens=True)}
KINDS = [("prompt", 1), ("prompt", 4), ("chat", 1), ("chat", 4)]


def index_lists(n: int, seed: int):
    """Index batches of sizes 1 and 3 over ``[-n, n)`` (negative: padding samples), fixed by ``seed``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for size in (1, 3):
        for _ in range(5):
            out.append([int(i) for i in rng.choice(np.arange(-n, n), size=min(size, 2 * n), replace=False)])
    return out


def packs_digest(path: str, mult: int) -> str:
    """SHA-256 over every pack's ids, loss mask and sequence starts, as our reader reads them."""
    import numpy as np

    from megatron_sft_idx.open import open_packed

    src = open_packed(path, pad_seq_to_mult=mult)
    h = hashlib.sha256()
    for i in range(len(src)):
        p = src[i]
        for a in (p.input_ids, p.loss_mask, p.seq_start_id):
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return h.hexdigest()


def compute(out_dir: str, commit: str, ref: str, file_sha256: str) -> None:
    """Phase 2, inside the "next" stack."""
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(HERE))
    import megatron_cpu  # noqa: F401  (before any megatron import)
    import numpy as np
    import torch
    from bridge_data import PACK_SIZE, bridge_tokenizer, write_bridge_artifacts
    from megatron.bridge.data.builders.gpt_sft import build_gpt_sft_split
    from megatron.bridge.data.packing import gpt_sft as packed_module

    if not os.path.realpath(packed_module.__file__).startswith(os.path.realpath(os.environ["MEGATRON_SFT_IDX_DEPS"])):
        raise SystemExit(f"{packed_module.__file__} is not the next stack's module")
    tokenizer = bridge_tokenizer()
    work = tempfile.mkdtemp(prefix="bridge_next_")
    arts = write_bridge_artifacts(__import__("pathlib").Path(work), tokenizer)
    cells, arrays = [], {}
    for kind, mult in KINDS:
        art = next(a for a in arts if (a.kind, a.pad_seq_to_mult) == (kind, mult))
        digest = packs_digest(art.npy, mult)
        for opt_name, opts in OPTION_SETS.items():
            for answer_only in (True, False):
                for source in ("npy", "parquet"):
                    path = art.npy if source == "npy" else art.parquet
                    ds = build_gpt_sft_split(
                        path, tokenizer=tokenizer, seq_length=PACK_SIZE, memmap_workers=1, seed=1234,
                        packed_sequence_size=PACK_SIZE, pack_metadata_path=art.metadata,
                        pad_cu_seqlens=opts["pad_cu_seqlens"], pad_seq_to_mult=mult,
                        dataset_kwargs={"pad_to_max_length": opts["pad_to_max_length"], "max_num_samples": None,
                                        "answer_only_loss": answer_only})
                    cid = len(cells)
                    batches = index_lists(len(ds), seed=cid)
                    values = []
                    for b, idx in enumerate(batches):
                        batch = ds.collate_fn([ds[i] for i in idx])
                        plain = {}
                        for key, value in batch.items():
                            if isinstance(value, torch.Tensor):
                                arrays[f"c{cid}_b{b}_{key}"] = value.numpy()
                                plain[key] = {"tensor": str(value.dtype).replace("torch.", "")}
                            else:
                                plain[key] = {"value": value}
                        values.append(plain)
                    cells.append({"id": cid, "kind": kind, "pad_seq_to_mult": mult, "options": opt_name,
                                  "answer_only_loss": answer_only, "source": source, "packs_sha256": digest,
                                  "num_packs": len(ds), "batches": batches, "keys": values})
    os.makedirs(out_dir, exist_ok=True)
    np.savez_compressed(os.path.join(out_dir, "batches.npz"), **arrays)
    doc = {"bridge_repository": "https://github.com/NVIDIA-NeMo/Megatron-Bridge", "bridge_commit": commit,
           "bridge_ref": ref, "bridge_file": UPSTREAM_PATH, "bridge_file_sha256": file_sha256,
           "base_stack": STACK, "eos_id": int(tokenizer.eos_id),
           "pack_size": PACK_SIZE, "generated_by": "tests/compat/make_bridge_next_golden.py", "cells": cells}
    with open(os.path.join(out_dir, "cells.json"), "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
    shutil.rmtree(work, ignore_errors=True)


def compare(new_dir: str, old_dir: str) -> dict:
    """Per ``(key, pad_seq_to_mult)``: batches of ``new_dir``'s fixture that differ from ``old_dir``'s.

    A key present on one side only counts as differing (``"only in new"``/``"only in old"``); for
    non-tensor keys only in the new fixture, the values seen are counted too.
    """
    import numpy as np

    docs, arrays = [], []
    for d in (new_dir, old_dir):
        with open(os.path.join(d, "cells.json")) as f:
            docs.append(json.load(f))
        arrays.append(np.load(os.path.join(d, "batches.npz")))
    (new, old), (new_arr, old_arr) = docs, arrays
    if [(c["kind"], c["pad_seq_to_mult"], c["options"], c["answer_only_loss"], c["source"], c["packs_sha256"],
         c["batches"]) for c in new["cells"]] != [
            (c["kind"], c["pad_seq_to_mult"], c["options"], c["answer_only_loss"], c["source"], c["packs_sha256"],
             c["batches"]) for c in old["cells"]]:
        raise SystemExit(f"{new_dir} and {old_dir} hold other cells or packs: nothing to compare")
    counts, batches, values = {}, {}, {}
    for cn, co in zip(new["cells"], old["cells"]):
        mult = cn["pad_seq_to_mult"]
        batches[mult] = batches.get(mult, 0) + len(cn["batches"])
        for b, (kn, ko) in enumerate(zip(cn["keys"], co["keys"])):
            for key in sorted(set(kn) | set(ko)):
                if key not in ko or key not in kn:
                    what = "only in new" if key in kn else "only in old"
                    if key in kn and "value" in kn[key]:
                        v = (key, mult, json.dumps(kn[key]["value"]))
                        values[v] = values.get(v, 0) + 1
                elif "tensor" in kn[key]:
                    x, y = new_arr[f"c{cn['id']}_b{b}_{key}"], old_arr[f"c{co['id']}_b{b}_{key}"]
                    if x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y):
                        continue
                    what = "differs"
                elif kn[key] == ko[key]:
                    continue
                else:
                    what = "differs"
                counts[(key, mult, what)] = counts.get((key, mult, what), 0) + 1
    print(f"{new_dir} ({new['bridge_commit'][:10]}) against {old_dir} ({old['bridge_commit'][:10]}); "
          f"batches per pad_seq_to_mult: {batches}")
    for (key, mult, what), n in sorted(counts.items()):
        print(f"  {key}: {what} in {n} of {batches[mult]} batches with pad_seq_to_mult={mult}")
    for (key, mult, value), n in sorted(values.items()):
        print(f"    {key} = {value} in {n} of them (pad_seq_to_mult={mult})")
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bridge-repo", help="a clone (or bare mirror) of NVIDIA-NeMo/Megatron-Bridge")
    parser.add_argument("--commit", default="HEAD")
    parser.add_argument("--out", default=GOLDEN)
    parser.add_argument("--compare", metavar="DIR", help="then print which batches differ from the fixture in DIR")
    parser.add_argument("--compute", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ref", help=argparse.SUPPRESS)
    parser.add_argument("--file-sha256", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compute:
        compute(args.out, args.commit, args.ref, args.file_sha256)
        return 0
    git = git_command(args.bridge_repo)
    commit = resolve(git, args.commit)
    source = files_at(git, commit, [UPSTREAM_PATH])[UPSTREAM_PATH]
    file_sha256 = hashlib.sha256(source).hexdigest()
    with tempfile.TemporaryDirectory(prefix="next_stack_") as work:
        stack = overlaid_stack(work, STACK, {MODULE: source})
        deps = os.path.dirname(stack)
        env = dict(os.environ, MEGATRON_SFT_IDX_STACK=STACK, MEGATRON_SFT_IDX_DEPS=deps,
                   PYTHONPATH=os.pathsep.join([stack, ROOT]), PYTHONWARNINGS="ignore")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--compute", "--out", args.out,
                        "--commit", commit, "--ref", args.commit, "--file-sha256", file_sha256],
                       check=True, env=env, cwd=ROOT)
    print(f"wrote {args.out} from Megatron-Bridge {commit} ({args.commit}; {UPSTREAM_PATH} sha256 {file_sha256})")
    if args.compare:
        compare(args.out, args.compare)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
