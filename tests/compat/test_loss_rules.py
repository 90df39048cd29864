"""The audit's replays of Megatron-LM's and Megatron-Bridge's loss normalisation against the
installed megatron-core's own schedule (every stack), and the served step counts through the
Megatron-LM door.

The gradient of one step is computed twice on a tiny model (embedding and output layer: every
position's loss depends on its token alone, so splitting a sequence over context-parallel ranks
changes only how losses are normalised): by megatron-core's ``schedules.forward_step`` /
``backward_step`` -- the functions ``forward_backward_no_pipelining`` runs per micro-batch, which
divide a micro-batch's loss sum by its token count and the micro-batch count, or not, per
``calculate_per_token_loss`` -- with each data-parallel and context-parallel rank's micro-batches
run in turn, then the two scalings the schedule leaves to other places, restated from the
installed code (DDP's ``gradient_scaling_factor`` 1 / (DP * CP), or none with per-token loss;
``finalize_model_grads``' division by the token count all-reduced over DP x CP); and as
``sum_t w_t * loss_t`` with ``w_t`` the audit's weight of the token's group
(:func:`megatron_sft_idx.batching.audit.group_weights`), its CP rank from the audit's own split.
The CP split of each rank's batch is Transformer Engine's ``thd_get_partitioned_indices``
restated here from its kernel (no CPU build), per segment of the batch's ``cu_seqlens``.
``forward_backward_no_pipelining`` itself allocates its token counter on CUDA.
"""

from functools import partial

import numpy as np
import pytest
import torch

from support.shardgen import random_packs, write_shard
from support.token_inputs import tokens_input

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_sft_idx import MMapIndexedDataset
from megatron_sft_idx.batching import CostModel, Order, Topology, plan_order, shard_pack_costs
from megatron_sft_idx.batching.audit import group_table, group_weights, rule_named
from megatron_sft_idx.batching.denominators import STEP_TOKENS_KEY
from megatron_sft_idx.batching.trained import (BRIDGE_06, LAYOUT_BRIDGE, LAYOUT_MEGATRON, STORED, cp_sequence_counts,
                                               step_table, trained_counts)
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess import Config, run
from megatron_sft_idx.training import megatron as M

DP, CP, MICRO, VOCAB, SEQ = 2, 2, 2, 40, 64
TOPO = Topology(DP, 1, DP * MICRO)


@pytest.fixture(autouse=True)
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def te_partition(bounds, cp, rank):
    """Transformer Engine's dual-chunk THD split, restated: each segment ``[b_i, b_{i+1})`` in
    ``2 * cp`` chunks, rank ``r`` taking chunks ``r`` and ``2 * cp - 1 - r``."""
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        chunk = (b - a) // (2 * cp)
        out += list(range(a + rank * chunk, a + (rank + 1) * chunk))
        out += list(range(a + (2 * cp - 1 - rank) * chunk, a + (2 * cp - rank) * chunk))
    return torch.tensor(out, dtype=torch.long)


class Tiny(torch.nn.Module):
    """Per-position losses from the position's token alone (megatron-core's model interface)."""

    def __init__(self, per_token):
        super().__init__()
        torch.manual_seed(0)
        self.config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                        calculate_per_token_loss=per_token, pipeline_dtype=torch.float32)
        self.model_type = ModelType.encoder_or_decoder
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.out = torch.nn.Linear(8, VOCAB)

    def forward(self, tokens, labels):
        logits = self.out(self.emb(tokens))
        return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1),
                                                 reduction="none").view(labels.shape)

    def set_input_tensor(self, tensor):
        pass


def megatron_lm_loss(loss_mask, output_tensor):
    """Megatron-LM's ``pretrain_gpt.loss_func`` (d98e8a64), its default branch: the micro-batch's
    loss sum, its token count and the report (megatron-core's three-value contract)."""
    losses = output_tensor.view(-1).float()
    loss = torch.sum(losses * loss_mask.view(-1).float())
    tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), tokens.view(1)])}


def loss_functions():
    out = [("megatron-lm", megatron_lm_loss)]
    try:
        from megatron.bridge.training.losses import masked_next_token_loss
    except ImportError:   # the megatron-core 0.16.1 stack has no Bridge
        return out
    return out + [("megatron-bridge", masked_next_token_loss)]


def schedule_grads(model, slices, per_token):
    """Megatron's gradient of one step: ``slices[d][c]`` the micro-batches of DP rank ``d`` on CP
    rank ``c``, each through ``forward_step``/``backward_step``; then DDP's and finalize's scaling."""
    store, total = [], 0
    model.zero_grad()
    for per_cp in slices:
        for micro in per_cp:
            it = iter(micro)
            for k in range(len(micro)):
                out, n = schedules.forward_step(lambda i, m: _step(i, m), it, model, len(micro), None, store,
                                                model.config, CP, is_first_microbatch=k == 0, current_microbatch=k)
                total += int(n)
                backward = schedules.backward_step
                if "model_type" in backward.__code__.co_varnames[:backward.__code__.co_argcount]:
                    backward(None, out, None, ModelType.encoder_or_decoder, model.config)
                else:
                    backward(None, out, None, model.config)
    scale = 1.0 / total if per_token else 1.0 / (DP * CP)
    return {n: p.grad.detach() * scale for n, p in model.named_parameters()}


def _step(it, model):
    batch = next(it)
    return model(batch["tokens"], batch["labels"]), partial(batch["loss_fn"], batch["loss_mask"])


def replay_grads(model, slices, weights):
    """``sum_t w_t loss_t``: ``weights[d][c][m]`` the audit's weight of group (d, m, c)."""
    model.zero_grad()
    total = 0.0
    for d, per_cp in enumerate(slices):
        for c, micro in enumerate(per_cp):
            for m, batch in enumerate(micro):
                losses = model(batch["tokens"], batch["labels"]) * batch["loss_mask"]
                total = total + float(weights[d][c][m]) * losses.sum()
    total.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def audit_weights(rule_name, order, per_seq_cp):
    """The audit's weight of every (rank, CP rank, micro-batch) group of step 0."""
    counts = order.trained
    cum = np.vstack((np.zeros((1, CP), np.int64), np.cumsum(per_seq_cp, axis=0)))
    pack_cp = cum[counts.sequence_offsets[1:]] - cum[counts.sequence_offsets[:-1]]
    table = np.stack([step_table(order.permutations.reshape(-1), pack_cp[:, c], TOPO) for c in range(CP)], axis=-1)
    rule = rule_named(rule_name)
    w = group_weights(rule, group_table(rule, table[:1]))[0]
    if w.shape[0] == 1:
        return [[[w[0]] * MICRO for _ in range(CP)] for _ in range(DP)]
    w = w.reshape(MICRO, DP, CP)
    return [[[w[m, d, c] for m in range(MICRO)] for c in range(CP)] for d in range(DP)]


def megatron_step(tmp_path, loss_fn):
    """Step 0 of a shuffled order of CP-padded packs, as each rank's CP slices of Megatron-LM samples."""
    prefix = str(tmp_path / "mlm")
    packs = random_packs(np.random.default_rng(12), 12, pack_size=SEQ, vocab=VOCAB, pad_mult=2 * CP, max_seqs=4)
    packs[3] = (packs[3][0], np.zeros_like(packs[3][1]), packs[3][2])   # (a pack that trains nothing)
    write_shard(prefix, packs, pack_size=SEQ, metadata={"pad_seq_to_mult": 2 * CP})
    ds = MMapIndexedDataset(prefix)
    model = CostModel(1.0, 1.0)
    order = plan_order(shard_pack_costs(ds, model), TOPO, model, seed=3, algorithm="shuffle",
                       trained=trained_counts(ds))
    slices = [[[] for _ in range(CP)] for _ in range(DP)]
    for g in range(DP * MICRO):   # step 0: micro-batch g // DP of rank g % DP (micro-batch size 1)
        sample = M._layout_pack(ds[int(order.permutations[0][g])], SEQ, 0, prefix)
        bounds = sorted(set(sample["cu_seqlens"].tolist()))
        for c in range(CP):
            idx = te_partition(bounds, CP, c)
            slices[g % DP][c].append({k: sample[k][idx][None] for k in ("tokens", "labels", "loss_mask")}
                                     | {"loss_fn": loss_fn})
    return ds, order, slices


@pytest.mark.parametrize("per_token, rule", [(True, "megatron-lm:per-token"), (False, "megatron-lm:per-micro-batch")])
@pytest.mark.parametrize("name, loss_fn", loss_functions())
def test_megatron_cores_gradient_is_the_replayed_weighting(tmp_path, per_token, rule, name, loss_fn):
    ds, order, slices = megatron_step(tmp_path, loss_fn)
    per_seq_cp = cp_sequence_counts(ds, CP, layout=LAYOUT_MEGATRON, seq_length=SEQ)
    real = schedule_grads(Tiny(per_token), slices, per_token)
    replay = replay_grads(Tiny(per_token), slices, audit_weights(rule, order, per_seq_cp))
    for n in real:
        torch.testing.assert_close(real[n], replay[n], rtol=1e-5, atol=1e-8)
    if not per_token:   # unequal CP shares: the per-micro-batch rule is not the token mean (#7513)
        exact = replay_grads(Tiny(True), slices, audit_weights("megatron-lm:per-token", order, per_seq_cp))
        assert not all(torch.allclose(real[n], exact[n], rtol=1e-3) for n in real)


def test_bridges_default_gradient_is_the_replayed_weighting(tmp_path):
    """Megatron-Bridge 0.6.2: its collate (EOS inputs zeroed), its loss function, its CP split of
    runtime segments, calculate_per_token_loss=False (its default)."""
    from megatron.bridge.training import losses   # (the Bridge stack only: conftest.BRIDGE_ONLY)
    from megatron_sft_idx.training.bridge import PackedSFTDataset

    eos, prefix = 3, str(tmp_path / "br")
    rng = np.random.default_rng(21)
    packs = []
    for _ in range(8):   # runtime layout: every sequence L - 1 a multiple of 2 * CP
        lengths = [int(rng.choice([5, 9, 13])) for _ in range(int(rng.integers(1, 4)))]
        ids = rng.integers(0, 6, sum(lengths))   # EOS (3) frequent
        loss = rng.integers(0, 2, sum(lengths)).astype(np.uint8)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        loss[np.cumsum(lengths) - 1] = 0
        packs.append((ids, loss, starts))
    write_shard(prefix, packs, pack_size=48, metadata={"pad_seq_to_mult": 2 * CP, "pad_layout": "runtime"})
    shard = MMapIndexedDataset(prefix)
    model = CostModel(1.0, 1.0)
    order = plan_order(shard_pack_costs(shard, model), TOPO, model, seed=5, algorithm="shuffle",
                       trained=trained_counts(shard, eos_id=eos))
    ds = PackedSFTDataset(prefix, eos_id=eos, bridge_semantics="0.6", balanced_order=order, seed=5,
                          pad_to_max_length=True, max_seq_length=48)
    slices = [[[] for _ in range(CP)] for _ in range(DP)]
    for g in range(DP * MICRO):
        batch = ds.collate_fn([ds[g]])
        bounds = batch["cu_seqlens_q_padded"][0].tolist()
        for c in range(CP):
            idx = te_partition(sorted(set(bounds)), CP, c)
            slices[g % DP][c].append({k: batch[k][:, idx] for k in ("tokens", "labels", "loss_mask")}
                                     | {"loss_fn": losses.masked_next_token_loss})
    per_seq_cp = cp_sequence_counts(shard, CP, layout=LAYOUT_BRIDGE, rule=BRIDGE_06, eos_id=eos)
    offsets = order.trained.sequence_offsets
    step0 = [int(order.permutations[0][g]) for g in range(DP * MICRO)]
    for g, p in enumerate(step0):   # the audit's CP split is what Bridge's batch puts on each CP rank
        got = [int(slices[g % DP][c][g // DP]["loss_mask"].sum()) for c in range(CP)]
        assert got == per_seq_cp[offsets[p]:offsets[p + 1]].sum(axis=0).tolist()
    real = schedule_grads(Tiny(False), slices, False)
    replay = replay_grads(Tiny(False), slices, audit_weights("megatron-bridge:default", order, per_seq_cp))
    for n in real:
        torch.testing.assert_close(real[n], replay[n], rtol=1e-5, atol=1e-8)


def test_the_megatron_lm_door_serves_each_steps_count(tmp_path):
    prefix = str(tmp_path / "chat")
    run(Config([tokens_input(tmp_path / "in.jsonl")], prefix, input_format="tokens", vocab_size=50, pad_id=0,
               pack_size=256, balance_for=(4, 1, 16), cost_model="1,1", balance_epochs=2, progress=False))
    order = Order.load(prefix + ".order")
    n = order.num_packs
    cfg = M.SFTIndexedDatasetConfig(random_seed=1234, sequence_length=256, blend=M.parse_data_path(prefix),
                                    split="100,0,0", path_to_cache=None, tokenizer=None, pack_order_file="auto",
                                    data_parallel_size=4, micro_batch_size=1, global_batch_size=16)
    train = BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, [2 * n, 0, 0], lambda: True, cfg).build()[0]
    per_step = order.step_trained(STORED).sum(axis=(1, 2))
    for step in (0, 1, (2 * n) // 16 - 1):   # the served count is what Megatron-LM's loss masks hold over the step
        served = {int(train[j][STEP_TOKENS_KEY]) for j in range(16 * step, 16 * step + 16)}
        masks = sum(int(train[j]["loss_mask"].sum()) for j in range(16 * step, 16 * step + 16))
        assert served == {int(per_step[step])} == {masks}
    # a shard whose masks changed after planning (the same index): the changed pack is refused when read
    packs = MMapIndexedDataset(prefix)
    changed = [(p.input_ids, p.loss_mask.copy(), p.seq_start_id) for p in (packs[i] for i in range(n))]
    ids, loss, starts = changed[5]
    loss[int(np.flatnonzero(loss)[0])] = 0
    write_shard(str(tmp_path / "changed"), changed, pack_size=256, vocab_size=50)
    order.save(str(tmp_path / "changed.order"))
    cfg.blend = M.parse_data_path(str(tmp_path / "changed"))
    other = BlendedMegatronDatasetBuilder(M.SFTIndexedDataset, [n, 0, 0], lambda: True, cfg).build()[0]
    at = int(np.flatnonzero(np.asarray(other.sample_index) == 5)[0])
    with pytest.raises(ShardError, match="pack 5 trains"):
        other[at]


def test_a_loss_over_the_served_count_is_the_token_mean_without_an_all_reduce(tmp_path):
    """The recipe of docs/TRAINING.md: with calculate_per_token_loss=False, a two-value loss
    function returning ``sum * DP * M / step_trained_tokens`` -- the schedule multiplies by CP and
    divides by M, DDP by DP * CP -- gives every token 1 / N of its step, the per-token rule's
    gradient, with no count all-reduced."""
    ds, order, slices = megatron_step(tmp_path, None)
    served = int(order.step_trained(STORED)[0].sum())

    def served_loss(loss_mask, output_tensor):
        loss = torch.sum(output_tensor.view(-1).float() * loss_mask.view(-1).float())
        return loss * DP * MICRO / served, {"lm loss": loss.detach().view(1)}

    for per_rank in slices:
        for micro in per_rank:
            for batch in micro:
                batch["loss_fn"] = served_loss
    real = schedule_grads(Tiny(False), slices, False)
    exact = replay_grads(Tiny(False), slices, audit_weights("megatron-lm:per-token", order,
                                                            cp_sequence_counts(ds, CP, layout=LAYOUT_MEGATRON,
                                                                               seq_length=SEQ)))
    for n in real:
        torch.testing.assert_close(real[n], exact[n], rtol=1e-5, atol=1e-8)
