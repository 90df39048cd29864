#!/usr/bin/env python3
"""Regenerate tests/golden/bridge_global_batch/: Megatron-Core's sequence-packing scheduler on our global-batch samples.

Megatron-Bridge 0.7's global-batch packing (#6127) is known here from its documentation only
(megatron_sft_idx/training/global_batch.py); its consumer, Megatron-Core's scheduler
(``megatron/core/datasets/data_schedule.py`` and ``data_schedule_utils.py`` on Megatron-LM's
``main``), is code that can be read. Its CPU parts run on our samples here; CI has no snapshot,
so what they return is committed as data (never their code). To regenerate, with Megatron-LM's
repository fetched (e.g. by the session's fetch tool to /work/.mirror/NVIDIA+Megatron-LM/repo)
and the 0.6.2 stack installed (``make install-compat``)::

    python3 tests/compat/make_bridge_global_batch_golden.py --megatron-lm-repo /path/to/Megatron-LM [--commit HEAD]

What it does:

1. builds the inputs (:func:`build_inputs`, which tests/training/test_global_batch.py calls too):
   a sequence store of the first :data:`CONVERSATIONS` example conversations (bundled tokenizer),
   and for each cell of :data:`CELLS` our samples of it (``GlobalBatchSequences``);
2. builds a stack in a temporary directory: ``.deps/megatron-bridge-0.6.2`` (megatron-core
   0.19.2) copied, the scheduler's two files written over it from ``--commit`` (``git show``);
   nothing else is changed; the one stub is tests/compat/megatron_cpu.py's stand-in for the MoE
   module that imports Triton (a GPU compiler), which ``megatron.core`` imports;
3. runs itself in a subprocess with that stack first on PYTHONPATH and, per cell, hands the
   samples to the scheduler as its ``run`` does on one data-parallel rank: ``_unpack_batch``
   (the "already unpacked" branch; it asserts the keys' shapes), the required-key check against
   ``DpBalancedScheduler.get_required_sample_keys``, ``get_groups_and_subsamples`` on ``(global
   id, padded_seq_len)`` -- what ``_get_global_seqlens_and_ids`` (an all-gather on CUDA) returns
   for one rank holding every sample --, ``build_packed_microbatches`` for each DPxCP rank, then
   ``_build_thd_padding_mask`` and ``_sanitize_thd_padding_values`` as its batch step does before
   CP slicing (the slicing itself is Transformer Engine's, not run): the tensors as the model
   gets them, the boundaries, the padding mask, and how many values sanitizing changed;
4. writes ``golden.json`` (cells, groups, the commit, the files' SHA-256, the digest of the
   samples it read) and ``arrays.npz``. Running it twice at one commit writes the same bytes.

``--compare`` (no ``--megatron-lm-repo``): for when Bridge's own code can be read (a 0.7 wheel,
or a snapshot holding #6127): ``--bridge-repo PATH [--bridge-commit REF]`` loads its
``megatron/bridge/data/packing/global_batch.py`` (what it imports of Bridge must be importable:
the wheel installed, or the repository's ``src/`` on PYTHONPATH), checks its ``REQUIRED_SAMPLE_KEYS`` against
ours and builds its sample of every stored sequence of each cell with its
``build_unpacked_sequence_sample`` (and ``fold_alignment_padding`` where the cell folds),
printing, per key, how many samples differ from ours (dtype, shape or values); it exits 1 when
anything differs and 2 when the file is not at that commit. Its keyword arguments are matched
by name (docs/TRAINING.md says which); an argument it cannot fill stops it, naming the signature.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))   # tests/, for support.upstream_git when run as a script
from support.upstream_git import files_at, git_command, overlaid_stack, resolve  # noqa: E402

GOLDEN = os.path.join(ROOT, "tests", "golden", "bridge_global_batch")
STACK = "megatron-bridge-0.6.2"
CONVERSATIONS = 40
PAD_ID = 0
#: Max tokens a DPxCP rank packs (the scheduler's ``max_seqlen_per_dp_cp_rank``) and DP size.
MAX_SEQLEN_PER_RANK = 512
DP_SIZE = 2
#: (name, cp, pad multiple, fold): CP 1; CP 2 (2*CP); CP 2 with SP over TP 4 (lcm(2*CP, CP*TP));
#: CP 2 folded (``fold_alignment_padding``).
CELLS = (("cp1", 1, 1, False), ("cp2", 2, 4, False), ("cp2_tp4_sp", 2, 8, False), ("cp2_fold", 2, 4, True))
SCHEDULER_FILES = ("megatron/core/datasets/data_schedule.py", "megatron/core/datasets/data_schedule_utils.py")
BRIDGE_FILE = "src/megatron/bridge/data/packing/global_batch.py"


def build_inputs(work: str) -> dict:
    """The store (first :data:`CONVERSATIONS` example conversations, bundled tokenizer) under ``work``."""
    from megatron_sft_idx.preprocess import Config, run

    data = os.path.join(work, "conversations.jsonl")
    with open(os.path.join(ROOT, "examples", "conversations.jsonl"), encoding="utf-8") as f:
        lines = [next(f) for _ in range(CONVERSATIONS)]
    with open(data, "w", encoding="utf-8") as f:
        f.writelines(lines)
    store = os.path.join(work, "store")
    run(Config(inputs=[data], output_prefix=os.path.join(work, "out", "chat"),
               tokenizer=os.path.join(ROOT, "examples", "tokenizer"), store=store, pack_size=4096, progress=False))
    return {"store": store}


def cell_samples(store: str, mult: int, fold: bool) -> list:
    """Our samples of every store sequence for one cell."""
    from megatron_sft_idx.preprocess.sequences import StoreSequences
    from megatron_sft_idx.training.global_batch import GlobalBatchSequences

    ds = GlobalBatchSequences(StoreSequences(store), pad_to_multiple_of=mult, pad_id=PAD_ID,
                              fold_alignment_padding=fold)
    return [ds[i] for i in range(len(ds))]


def samples_digest(samples: list) -> str:
    h = hashlib.sha256()
    for s in samples:
        for key in sorted(s):
            t = s[key]
            h.update(f"{key}:{t.dtype}:{tuple(t.shape)}:".encode())
            h.update(t.numpy().tobytes())
    return h.hexdigest()


def compute(out_dir: str, store: str, doc: dict) -> None:
    """Phase 3, inside the stack: the scheduler's CPU steps on each cell's samples."""
    sys.path.insert(0, HERE)
    import megatron_cpu  # noqa: F401  (before any megatron import: its Triton stand-in)
    import numpy as np
    import torch
    from megatron.core.datasets import data_schedule as ds_mod
    from megatron.core.datasets import data_schedule_utils as utils

    if not os.path.realpath(ds_mod.__file__).startswith(os.path.realpath(os.environ["MEGATRON_SFT_IDX_DEPS"])):
        raise SystemExit(f"{ds_mod.__file__} is not the stack's module")
    arrays, cells = {}, []
    for name, cp, mult, fold in CELLS:
        samples = cell_samples(store, mult, fold)
        digest = samples_digest(samples)
        batch = utils._unpack_batch([dict(s) for s in samples])
        scheduler = ds_mod.DpBalancedScheduler(MAX_SEQLEN_PER_RANK, cp, DP_SIZE, None)
        for key in scheduler.get_required_sample_keys():
            assert key in batch[0], key
        global_id_seqlens = [(i, int(s["padded_seq_len"].item())) for i, s in enumerate(batch)]
        groups = scheduler.get_groups_and_subsamples(global_id_seqlens)
        ranks = cp * DP_SIZE
        cell = {"name": name, "cp": cp, "pad_to_multiple_of": mult, "fold": fold, "samples_sha256": digest,
                "samples": len(samples), "microbatches": len(groups),
                "groups": [[list(map(int, groups[m][r])) for r in range(ranks)] for m in range(len(groups))]}
        # the CP ranks of a DP group get the same bins (Transformer Engine splits them later): one recorded
        cell["cp_ranks_share_bins"] = all(groups[m][r] == groups[m][r - r % cp] for m in range(len(groups))
                                          for r in range(ranks))
        for r in range(0, ranks, cp):
            grouped = [[batch[i] for i in groups[m][r]] for m in range(len(groups))]
            for m, packed in enumerate(utils.build_packed_microbatches(grouped, torch.device("cpu"))):
                mask = ds_mod._build_thd_padding_mask(packed["cu_seqlens"], packed["cu_seqlens_padded"])
                clean = dict(packed)
                ds_mod._sanitize_thd_padding_values(clean, mask)
                stem = f"{name}_r{r}_m{m}"
                for key in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
                    arrays[f"{stem}_{key}"] = packed[key].reshape(-1).numpy()
                for key in ("tokens", "labels", "loss_mask", "position_ids"):   # as the model gets them
                    arrays[f"{stem}_{key}"] = clean[key].numpy()
                    changed = int((clean[key] != packed[key]).sum())   # what sanitizing changed
                    cell.setdefault("sanitized", {})[key] = cell.get("sanitized", {}).get(key, 0) + changed
                arrays[f"{stem}_padding_mask"] = mask.numpy()
        cells.append(cell)
    doc.update(cells=cells, required_keys=list(ds_mod.DpBalancedScheduler(1, 1, 1, None).get_required_sample_keys()))
    os.makedirs(out_dir, exist_ok=True)
    np.savez_compressed(os.path.join(out_dir, "arrays.npz"), **arrays)
    with open(os.path.join(out_dir, "golden.json"), "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")


def compare_bridge(repo: str, ref: str) -> int:
    """``--compare``: Bridge's own sample builder at ``ref`` against ours (module doc)."""
    import importlib.util

    import numpy as np

    from megatron_sft_idx.preprocess.sequences import StoreSequences
    from megatron_sft_idx.training.global_batch import REQUIRED_SAMPLE_KEYS

    shown = subprocess.run(git_command(repo) + ["show", f"{ref}:{BRIDGE_FILE}"], capture_output=True)
    if shown.returncode != 0:
        print(f"{BRIDGE_FILE} is not at {ref} of {repo}: nothing to compare", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bridge_gb_") as work:
        path = os.path.join(work, "global_batch.py")
        with open(path, "wb") as f:
            f.write(shown.stdout)
        spec = importlib.util.spec_from_file_location("bridge_global_batch", path)
        theirs = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(theirs)
        if tuple(theirs.REQUIRED_SAMPLE_KEYS) != REQUIRED_SAMPLE_KEYS:
            print(f"REQUIRED_SAMPLE_KEYS differ: theirs {theirs.REQUIRED_SAMPLE_KEYS}, ours {REQUIRED_SAMPLE_KEYS}")
            return 1
        build, params = theirs.build_unpacked_sequence_sample, inspect.signature(theirs.build_unpacked_sequence_sample)
        inputs = build_inputs(work)
        sequences = StoreSequences(inputs["store"])
        differs = {}
        for name, _, mult, fold in CELLS:
            ours = cell_samples(inputs["store"], mult, fold)
            for g, mine in enumerate(ours):
                item = sequences[g]
                known = {"input_ids": item.input_ids, "tokens": item.input_ids, "loss_mask": item.loss_mask,
                         "pad_to_multiple_of": mult, "pad_token_id": PAD_ID, "pad_id": PAD_ID}
                kwargs = {}
                for p in params.parameters.values():
                    if p.name in known:
                        kwargs[p.name] = known[p.name]
                    elif p.default is inspect.Parameter.empty:
                        raise SystemExit(f"cannot fill {p.name!r} of build_unpacked_sequence_sample{params}")
                sample = build(**kwargs)
                if fold:
                    sample = theirs.fold_alignment_padding(sample) or sample
                for key in REQUIRED_SAMPLE_KEYS:
                    a, b = sample.get(key), mine[key]
                    same = a is not None and a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and \
                        np.array_equal(a.numpy(), b.numpy())
                    if not same:
                        differs[(name, key)] = differs.get((name, key), 0) + 1
        print(f"Bridge {ref} against ours: {len(sequences)} sequences a cell")
        for (name, key), n in sorted(differs.items()):
            print(f"  {name:12} {key:18} {n} samples differ")
        return 1 if differs else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm-repo", help="a clone (or bare mirror) of NVIDIA/Megatron-LM")
    parser.add_argument("--commit", default="HEAD")
    parser.add_argument("--out", default=GOLDEN)
    parser.add_argument("--compare", action="store_true", help="compare Bridge's own sample builder with ours")
    parser.add_argument("--bridge-repo", help="with --compare: a clone (or bare mirror) of NVIDIA-NeMo/Megatron-Bridge")
    parser.add_argument("--bridge-commit", default="HEAD")
    parser.add_argument("--compute", metavar="DOC_JSON", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compute:
        with open(args.compute) as f:
            compute(args.out, args.store, json.load(f))
        return 0
    if args.compare:
        if not args.bridge_repo:
            parser.error("--compare needs --bridge-repo")
        return compare_bridge(args.bridge_repo, args.bridge_commit)
    if not args.megatron_lm_repo:
        parser.error("--megatron-lm-repo is required")
    git = git_command(args.megatron_lm_repo)
    commit = resolve(git, args.commit)
    sources = files_at(git, commit, SCHEDULER_FILES)
    with tempfile.TemporaryDirectory(prefix="bridge_gb_") as work:
        inputs = build_inputs(work)
        stack = overlaid_stack(work, STACK, sources)
        deps = os.path.dirname(stack)
        doc = {"megatron_lm_repository": "https://github.com/NVIDIA/Megatron-LM", "megatron_lm_commit": commit,
               "megatron_lm_ref": args.commit, "base_stack": STACK, "conversations": CONVERSATIONS, "pad_id": PAD_ID,
               "max_seqlen_per_dp_cp_rank": MAX_SEQLEN_PER_RANK, "dp_size": DP_SIZE,
               "files_sha256": {p: hashlib.sha256(s).hexdigest() for p, s in sorted(sources.items())},
               "generated_by": "tests/compat/make_bridge_global_batch_golden.py"}
        doc_path = os.path.join(work, "doc.json")
        with open(doc_path, "w") as f:
            json.dump(doc, f)
        env = dict(os.environ, MEGATRON_SFT_IDX_STACK=STACK, MEGATRON_SFT_IDX_DEPS=deps,
                   PYTHONPATH=os.pathsep.join([stack, ROOT]), PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--compute", doc_path, "--out",
                        os.path.abspath(args.out), "--store", inputs["store"]], check=True, env=env, cwd=ROOT)
    print(f"wrote {args.out} from Megatron-LM {commit} ({args.commit})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
