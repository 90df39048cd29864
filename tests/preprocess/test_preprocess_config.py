"""The run settings, defined once (preprocess/config.py) and filled by both commands' CLIs.

Each shared flag is read into the same settings field by preprocess-sft and repack-sft; the
configurations' defaults are the flags' defaults; the flat keywords of the configurations as
they were before the settings were grouped still build (and read back) the same thing.
"""

import dataclasses

import pytest

from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess import Config, PackSettings, RepackConfig, RunSettings, TokenizeSettings
from megatron_sft_idx.preprocess.cli import _config, build_parser
from megatron_sft_idx.preprocess.repack_cli import _repack_config, build_repack_parser
from megatron_sft_idx.preprocess.config import PackJob, PlanSettings

PRE = ["--input", "a.jsonl", "--output-prefix", "/o/ds", "--tokenizer", "tok"]
RE = ["--store", "/s", "--output-prefix", "/o/ds"]
# A value other than the default for every packing, execution and check flag both commands take.
SHARED = ["--pack-size", "2048", "--packing-algorithm", "best_fit_decreasing", "--seed", "7", "--overlong", "drop",
          "--truncated-turn-loss", "drop", "--pad-seq-to-mult", "8", "--pad-layout", "runtime", "--cp", "2",
          "--tp", "4", "--sp", "--fp8", "mxfp8", "--pad-id", "3", "--split", "98,1,1", "--max-packs-per-shard", "10",
          "--max-shard-bytes", "1G", "--skip-bad", "--workers", "3", "--engine", "ray", "--ray-address", "h:1",
          "--resume", "--overwrite", "--check", "--verify-masks", "5", "--staging-dir", "/st"]


def without_progress(settings: RunSettings) -> RunSettings:
    return dataclasses.replace(settings, progress=None)


def test_the_configurations_defaults_are_the_flags_defaults():
    cli = _config(build_parser().parse_args(PRE))
    api = Config(["a.jsonl"], "/o/ds", tokenizer="tok")
    assert (cli.tokenize, cli.pack, cli.store) == (api.tokenize, api.pack, api.store)
    assert without_progress(cli.run) == without_progress(api.run)
    cli = _repack_config(build_repack_parser().parse_args(RE))
    api = RepackConfig("/s", "/o/ds")
    assert (cli.pack, cli.plan_only, cli.tokenizer) == (api.pack, api.plan_only, api.tokenizer)
    assert without_progress(cli.run) == without_progress(api.run)


def test_each_shared_flag_fills_the_same_field_for_both_commands():
    pre = _config(build_parser().parse_args(PRE + SHARED))
    re = _repack_config(build_repack_parser().parse_args(RE + SHARED))
    assert pre.pack == re.pack and without_progress(pre.run) == without_progress(re.run)
    # every field moved off its default: no flag of the group is read into another field, or dropped
    for given, default in ((pre.pack, PackSettings()), (without_progress(pre.run), RunSettings(progress=None))):
        for f in dataclasses.fields(given):
            if f.name != "progress":
                assert getattr(given, f.name) != getattr(default, f.name), f.name


def test_flat_keywords_build_and_read_the_grouped_configuration():
    flat = Config(["a.jsonl"], "/o/ds", tokenizer="tok", batch_size=64, pack_size=8192, cp=2, workers=4,
                  check=True, store="/s")
    grouped = Config(["a.jsonl"], "/o/ds", store="/s", tokenize=TokenizeSettings(tokenizer="tok", batch_size=64),
                     pack=PackSettings(pack_size=8192, cp=2), run=RunSettings(workers=4, check=True))
    assert flat == grouped
    assert (flat.pack_size, flat.cp, flat.workers, flat.tokenizer, flat.batch_size) == (8192, 2, 4, "tok", 64)
    # a flat name given with its group sets that field on top of the group
    assert Config(["a"], "o", pack=PackSettings(pack_size=8192, cp=2), cp=4).pack == PackSettings(pack_size=8192, cp=4)
    assert dataclasses.replace(flat, workers=8).run == RunSettings(workers=8, check=True)
    assert RepackConfig("/s", None, plan_only="/p", pack_size=512, split=[90, 10]).pack == \
        PackSettings(pack_size=512, split=[90, 10])


def test_a_keyword_of_no_group_is_refused_and_configurations_are_values():
    with pytest.raises(TypeError, match="unexpected keyword argument 'pack_sise'"):
        Config(["a"], "o", pack_sise=4096)
    with pytest.raises(TypeError, match="unexpected keyword argument 'inputs'"):
        RepackConfig("/s", "o", inputs=["a"])       # preprocess-sft's own field
    with pytest.raises(AttributeError, match="pack_sise"):
        Config(["a"], "o").pack_sise
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config(["a"], "o").workers = 2


def test_the_plan_settings_and_the_job_are_resolved_from_the_pack_settings():
    pack = PackSettings(pack_size=1024, pad_seq_to_mult=3, cp=2, split=[98, 1, 1], truncated_turn_loss="drop")
    plan = pack.plan_settings(vocab_size=70000)
    assert plan == PlanSettings(pack_size=1024, pad_multiple=12, algorithm=pack.algorithm, seed=1234,
                                split=(98, 1, 1), overlong="truncate", skip_bad=False, max_packs_per_shard=None,
                                max_shard_bytes=None, itemsize=4, pad_layout="stored", truncated_turn_loss="drop")
    assert pack.plan_settings(vocab_size=65536).itemsize == 2
    job = PackJob.resolve("/o/ds", pack, RunSettings(), vocab_size=70000, default_pad_id=5)
    assert (job.settings, job.pad_id, job.parallelism) == (plan, 5, (2, 1, False))
    assert job.bases == ["/o/ds_train", "/o/ds_valid", "/o/ds_test"]
    assert PackJob.resolve("/o/ds", dataclasses.replace(pack, pad_id=9), RunSettings(), 70000, 5).pad_id == 9
    with pytest.raises(ShardError, match="padding multiple 12 exceeds --pack-size 8"):
        dataclasses.replace(pack, pack_size=8).plan_settings(None)
    with pytest.raises(ShardError, match="no usable pad id"):
        PackJob.resolve("/o/ds", pack, RunSettings(), vocab_size=100, default_pad_id=100)


def test_a_plan_files_settings_are_parsed_once_into_plan_settings():
    """What a plan file records reads back as the PlanSettings that wrote it; a key an older plan
    lacks is the given settings' default; a bad value is a HeaderError naming the field."""
    from megatron_sft_idx.errors import HeaderError
    from megatron_sft_idx.jsondoc import Doc, normal_json

    plan = PackSettings(pack_size=1024, cp=2, split=[98, 1, 1], truncated_turn_loss="drop").plan_settings(70000)
    assert PlanSettings.from_doc(Doc(normal_json(plan.to_dict()), "x.plan", "settings")) == plan
    old = normal_json(dataclasses.replace(plan, truncated_turn_loss="keep").to_dict())
    del old["pad_layout"]
    assert "truncated_turn_loss" not in old
    back = PlanSettings.from_doc(Doc(old, "x.plan", "settings"))
    assert (back.pad_layout, back.truncated_turn_loss) == (PackSettings().pad_layout, PackSettings().truncated_turn_loss)
    for key, value, field in (("split", [98, 0, 1], "settings.split[1]"), ("split", [1, 1, 1, 1], "settings.split"),
                              ("pad_multiple", 2048, "settings.pad_multiple"), ("skip_bad", 0, "settings.skip_bad"),
                              ("max_shard_bytes", 0, "settings.max_shard_bytes"),
                              ("truncated_turn_loss", "cut", "settings.truncated_turn_loss")):
        with pytest.raises(HeaderError) as e:
            PlanSettings.from_doc(Doc({**normal_json(plan.to_dict()), key: value}, "x.plan", "settings", HeaderError))
        assert e.value.field == field and e.value.path == "x.plan"


def test_the_encoding_settings_are_defined_once_and_the_workers_options_built_from_them():
    """TokenizeSettings and EncodeOptions both extend EncodeSettings (records/encode.py): no field
    of either restates one of it, and the options the run gives its workers carry every
    encoding setting as given, with the resolved tokenizer, vocabulary and template."""
    from megatron_sft_idx.preprocess.records.encode import EncodeOptions, EncodeSettings

    def own(cls):
        return {f.name for f in dataclasses.fields(cls)} - {f.name for f in dataclasses.fields(EncodeSettings)}

    assert issubclass(TokenizeSettings, EncodeSettings) and issubclass(EncodeOptions, EncodeSettings)
    assert own(TokenizeSettings) == {"tokenizer", "chat_template", "batch_size", "partition_bytes", "max_record_bytes",
                                     "skip_report"}
    assert own(EncodeOptions) == {"tokenizer_path", "skip_bad", "chat_template_text", "tokenizer_files"}
    args = build_parser().parse_args(PRE + ["--loss-on", "last-turn", "--ignore-field", "id", "--prompt-format", "raw",
                                            "--reasoning-loss", "mask", "--span-method", "prefix"])
    tk = _config(args).tokenize
    opts = tk.encode_options(tokenizer_path="/abs/tok", vocab_size=777, skip_bad=True, chat_template_text="{{x}}")
    for f in dataclasses.fields(EncodeSettings):
        if f.name != "vocab_size":
            assert getattr(opts, f.name) == getattr(tk, f.name), f.name
    assert (opts.vocab_size, opts.tokenizer_path, opts.skip_bad, opts.chat_template_text) == (777, "/abs/tok", True,
                                                                                              "{{x}}")
    assert opts.ignore_fields == ("id",) and hash(opts)   # a dict key of the workers' encoders
    assert TokenizeSettings(ignore_fields=["id"]).ignore_fields == ("id",)


def test_the_package_face_names_the_run_and_the_repack_function():
    import megatron_sft_idx.preprocess as face
    from megatron_sft_idx.preprocess import config, driver

    assert (face.Config, face.RepackConfig, face.run, face.repack) == (config.Config, config.RepackConfig,
                                                                      driver.run, driver.repack)
    assert callable(face.repack) and "repack" in dir(face)
