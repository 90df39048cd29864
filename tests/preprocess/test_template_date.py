"""Templates that read the clock render a pinned date (``--template-date``).

Meta's Llama 3.1/3.2 templates print today's date through ``strftime_now``: unpinned, the bytes
change with the time zone and the day, ``--verify-masks`` of yesterday's store fails and a
resume across midnight mixes dates. Pinned, the date is one option, recorded in the store and
the shards, reused by ``--resume``/``--store``, ``repack-sft`` and the verification; a store made
with another date is refused naming both. Templates that do not read the clock record nothing,
so their stores and shards keep their bytes.
"""

import datetime
import json
import os
import time

import pytest

from support.chat_families import with_template
from support.sft_fixtures import write_jsonl
from megatron_sft_idx.errors import ShardError
from megatron_sft_idx.preprocess import RepackConfig
from megatron_sft_idx.preprocess import tokenize as tokenize_stage
from megatron_sft_idx.preprocess.driver import repack
from megatron_sft_idx.preprocess import Config, run
from megatron_sft_idx.preprocess.records.chat import ChatTokenizer
from megatron_sft_idx.preprocess.records.template_clock import utc_today
from megatron_sft_idx.reader import MMapIndexedDataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE_TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")

# Llama-3.1-like: the date printed in the system header, as upstream does with strftime_now
CLOCK = ("{%- if strftime_now is defined %}{% set date_string = strftime_now('%d %b %Y') %}"
         "{%- else %}{% set date_string = '26 Jul 2024' %}{% endif %}"
         "{{ '<|im_start|>system\\nToday Date: ' + date_string + '<|im_end|>\\n' }}"
         "{%- for m in messages %}{% if m.role != 'system' %}"
         "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
         "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
ZONES = ("Pacific/Kiritimati", "Etc/GMT+12", "UTC")   # UTC+14 and UTC-12: on different days most of the time


@pytest.fixture(scope="module")
def clock_tok(tmp_path_factory):
    return with_template(str(tmp_path_factory.mktemp("clock") / "tok"), EXAMPLE_TOKENIZER, CLOCK)


@pytest.fixture
def zone(monkeypatch):
    def set_zone(name):
        monkeypatch.setenv("TZ", name)
        time.tzset()
    yield set_zone
    monkeypatch.delenv("TZ", raising=False)
    time.tzset()


def chat(i):
    return {"messages": [{"role": "user", "content": f"Question {i}: what day is it?"},
                         {"role": "assistant", "content": f"Day {i} of the rest of your life."}]}


def conversation():
    return [{"role": "user", "content": "What day is it?"}, {"role": "assistant", "content": "A good one."}]


def test_the_pinned_date_is_rendered_in_every_time_zone(clock_tok, zone):
    texts, local_days = set(), set()
    for name in ZONES:
        zone(name)
        local_days.add(datetime.datetime.now().strftime("%d %b %Y"))   # what an unpinned clock prints
        tok = ChatTokenizer(clock_tok, template_date="2024-07-26")
        assert tok.reads_clock and tok.template_date == "2024-07-26"
        texts.add(tok.render(conversation()))
    assert len(local_days) > 1   # UTC+14 and UTC-12 are never on the same day: the zones do matter
    assert len(texts) == 1 and "Today Date: 26 Jul 2024" in texts.pop()
    # the default is today's UTC date, taken once: not the local day of the time zone
    zone("Pacific/Kiritimati")
    assert ChatTokenizer(clock_tok).template_date == utc_today()


def test_a_template_without_the_clock_records_no_date(tmp_path):
    tok = ChatTokenizer(EXAMPLE_TOKENIZER, template_date="2024-07-26")
    assert not tok.reads_clock and tok.template_date is None and "strftime_now" not in tok.template_kwargs
    s = go(tmp_path, EXAMPLE_TOKENIZER, "plain", template_date="2024-07-26")
    store = json.load(open(os.path.join(s["store"], "store.json")))
    assert "template_date" not in store["identity"]["encode"]
    assert "template_date" not in MMapIndexedDataset(s["outputs"][0]).metadata.extra


def go(tmp_path, tokenizer, name, records=None, data=None, **kw):
    path = tmp_path / f"{data or name}.jsonl"
    if not path.exists():
        write_jsonl(path, records or [chat(i) for i in range(6)])
    kw.setdefault("store", str(tmp_path / f"store_{data or name}"))
    return run(Config(inputs=[str(path)], output_prefix=str(tmp_path / "out" / name), tokenizer=tokenizer,
                      pack_size=1024, progress=False, verify_masks=6, **kw))


def shard_bytes(prefix):
    return [open(prefix + suffix, "rb").read() for suffix in (".bin", ".loss.bin", ".idx")]


def test_runs_in_other_time_zones_write_the_same_bytes_and_record_the_date(tmp_path, clock_tok, zone):
    outs = []
    for i, name in enumerate(ZONES):
        zone(name)
        s = go(tmp_path, clock_tok, f"tz{i}", records=[chat(j) for j in range(6)],
               template_date="2024-07-26")
        outs.append(shard_bytes(s["outputs"][0]))
        ds = MMapIndexedDataset(s["outputs"][0])
        assert ds.metadata.extra["template_date"] == "2024-07-26"
        assert "Today Date: 26 Jul 2024" in ChatTokenizer(clock_tok).decode(ds[0].input_ids)
        store = json.load(open(os.path.join(s["store"], "store.json")))
        assert store["identity"]["encode"]["template_date"] == "2024-07-26"
    assert outs[0] == outs[1] == outs[2]


def test_default_date_is_recorded_and_reused_the_next_day(tmp_path, clock_tok, monkeypatch):
    monkeypatch.setattr(tokenize_stage, "utc_today", lambda: "2024-07-26")
    first = go(tmp_path, clock_tok, "day")
    assert MMapIndexedDataset(first["outputs"][0]).metadata.extra["template_date"] == "2024-07-26"
    before = shard_bytes(first["outputs"][0])
    # the next day: the store being continued keeps its date (nothing is tokenized again) ...
    monkeypatch.setattr(tokenize_stage, "utc_today", lambda: "2024-07-27")
    again = go(tmp_path, clock_tok, "day2", data="day", resume=True)
    assert again["verify_masks"]["failures"] == 0 and shard_bytes(again["outputs"][0]) == before
    # ... and repack-sft's verification renders the store's date, not today's
    s = repack(RepackConfig(store=first["store"], output_prefix=str(tmp_path / "re" / "day"), pack_size=1024,
                            progress=False, verify_masks=6))
    assert s["verify_masks"]["failures"] == 0 and shard_bytes(s["outputs"][0]) == before
    # another date given for that store: refused, naming both dates
    with pytest.raises(ShardError, match="template date") as e:
        go(tmp_path, clock_tok, "day3", data="day", resume=True, template_date="2024-07-27")
    assert "2024-07-26" in str(e.value) and "2024-07-27" in str(e.value)


def test_resume_across_midnight_keeps_the_interrupted_run_s_date(tmp_path, clock_tok, monkeypatch):
    import megatron_sft_idx.preprocess.stages as stages

    monkeypatch.setattr(tokenize_stage, "utc_today", lambda: "2024-07-26")
    real_pack = stages.Stages.pack

    def interrupted(self, store):
        raise KeyboardInterrupt
    monkeypatch.setattr(stages.Stages, "pack", interrupted)
    with pytest.raises(KeyboardInterrupt):
        go(tmp_path, clock_tok, "own", store=None)
    work = tmp_path / "out" / ".own.preprocess"
    assert tokenize_stage.recorded_template_date(str(work / "store")) == "2024-07-26"
    monkeypatch.setattr(stages.Stages, "pack", real_pack)
    monkeypatch.setattr(tokenize_stage, "utc_today", lambda: "2024-07-27")   # the next day
    s = go(tmp_path, clock_tok, "own", store=None, resume=True)
    assert s["resumed_units"]["tokenize"] > 0 and s["verify_masks"]["failures"] == 0
    assert MMapIndexedDataset(s["outputs"][0]).metadata.extra["template_date"] == "2024-07-26"
    fresh = go(tmp_path, clock_tok, "fresh", store=None, template_date="2024-07-26")
    assert shard_bytes(fresh["outputs"][0]) == shard_bytes(s["outputs"][0])
    # resumed once more, the day after: the finished run is done, not redone with that day's date
    monkeypatch.setattr(tokenize_stage, "utc_today", lambda: "2024-07-28")
    done = go(tmp_path, clock_tok, "own", store=None, resume=True)
    assert done["resumed_units"] == {"done": 1} and done["outputs"] == s["outputs"]
    assert MMapIndexedDataset(s["outputs"][0]).metadata.extra["template_date"] == "2024-07-26"


def test_a_bad_date_is_refused():
    with pytest.raises(ShardError, match="not a date"):
        ChatTokenizer(os.path.join(ROOT, "examples", "tokenizer"), CLOCK, template_date="26/07/2024")


def test_a_check_on_another_date_names_both_dates(clock_tok):
    from megatron_sft_idx.preprocess.checks import _Checker
    from megatron_sft_idx.preprocess.records.encode import EncodeOptions

    made = ChatTokenizer(clock_tok, template_date="2024-07-26")
    ids, mask = made.encode_chat(conversation(), "assistant", "d.jsonl", 1)
    encode = EncodeOptions(tokenizer_path=clock_tok, vocab_size=None, loss_on="assistant", input_format="auto",
                           prompt_key="prompt", completion_key="completion", skip_bad=False,
                           template_date="2024-07-26").to_dict()
    raw = json.dumps({"messages": conversation()})
    assert _Checker(made, encode).check(raw, ids, mask, "d.jsonl", 1, 0) == ""
    why = _Checker(ChatTokenizer(clock_tok, template_date="2024-07-27"), encode).check(raw, ids, mask, "d.jsonl",
                                                                                      1, 0)
    assert "token ids differ" in why and "checked with template date 2024-07-27" in why
    del encode["template_date"]   # a store made before dates were pinned
    why = _Checker(ChatTokenizer(clock_tok, template_date="2024-07-27"), encode).check(raw, ids, mask, "d.jsonl",
                                                                                      1, 0)
    assert "records none" in why
