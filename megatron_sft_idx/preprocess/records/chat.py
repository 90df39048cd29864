"""Tokenizer loading, chat-template rendering and assistant loss masks.

Masks come from rendering *prefixes* of the conversation, not from
``{% generation %}`` markers, so they are right for any template: assistant
turn k spans the characters between ``render(messages[:k], add_generation_prompt=True)``
and ``render(messages[:k+1])`` in the full rendering, minus trailing whitespace
after its end-of-turn token. The tokens that start inside that span are trained
(so the end-of-turn token is), then the token-level flags are converted to the
LABEL-ALIGNED mask the shard stores: ``mask[j] = trained[j+1]``, last position 0.

Loss modes: ``assistant`` (every assistant turn), ``last-turn`` (the last
assistant turn only), ``all`` (every token), ``per-turn`` (one training sequence
per assistant turn: the conversation up to and including that turn, rendered as
the template renders a conversation ending there, loss on that turn only). Which
assistant turns count, and which parts of a turn are cut out (reasoning, empty
reasoning blocks), is the loss policy's (:mod:`.policy`); the conversation is
first adapted to what the template renders and every rendering is checked to hold
every message's text (:mod:`.rendering`).

Templates whose rendering of earlier turns depends on later ones (thinking
templates that drop ``<think>`` from the history, Qwen3- and DeepSeek-R1-style)
are not prefix-stable. Two differences are allowed by rule (:meth:`ChatTokenizer.prefix_spans`):
a generation prompt that opens a reasoning block the turn's rendering omits (the block counts as
prompt), and a reasoning block shown for the final turn only (taken as the history shows it:
empty, never trained under the default ``--empty-reasoning-loss mask``; non-empty, the turn is
trained as rendered without it). Anything else is refused under ``assistant``, naming the modes
that work (``last-turn``, ``per-turn``, ``all``). Each turn's stop is the template's end token,
or the next role's token with the tokenizer's end-of-sequence token appended after the last turn
(:mod:`.stops`), and every record's trained runs are checked to end with one.

Templates that read the clock (``strftime_now``, as Meta's Llama 3.1/3.2 templates print
today's date) render a pinned date instead: ``template_date`` (``--template-date``; the run
records the UTC date it started on), so the bytes do not depend on the time zone or the day.

This module is the reference implementation: :mod:`.encode` produces the same
ids and masks faster (one render, batched tokenization) and is pinned to it.
"""

from __future__ import annotations

import hashlib
import os
from typing import List, Optional, Tuple

import numpy as np

from ..._extras import require_extra
from ...errors import ShardError
from ...jsondoc import load_json
from .errors import input_error
from .masks import label_aligned, trained_from_offsets
from .policy import (DEFAULT_POLICY, LossPolicy, as_history, refine_spans, require_trainable, trained_turns,
                     without_opened_block)
from .call_text import call_renderer
from .rendering import TemplateTraits, adapt, check_rendered, probe
from .shapes import Conversation, SchemaOptions, as_conversation
from .stops import Stops
from .template_clock import check_template_date, pinned_clock, reads_clock, utc_today
from .template_compile import compile_template
from .tokenizer_source import TOKENIZER_FILES, local_tokenizer

LOSS_MODES = ("assistant", "last-turn", "all", "per-turn")
PREFIX_HINT = ("use --loss-on last-turn (loss on the final assistant turn, history as the template renders it), "
               "--loss-on per-turn (one training sequence per assistant turn, each rendered as the template "
               "renders it at that turn) or --loss-on all")
LAST_TURN_HINT = ("the prompt before this turn renders differently from the same messages as history (a system "
                  "prompt placed only with a final user turn, as Mistral's v0.3 template does): use --loss-on all, "
                  "or a template whose history renders as its prompt (--chat-template)")
TEMPLATE_HINT = ("pass --chat-template FILE (a Jinja chat template) or --chat-template NAME (one of the "
                 "tokenizer's named templates), or use a tokenizer directory whose tokenizer_config.json "
                 "has a chat_template (prompt/completion strings need none with --prompt-format raw)")
_TOKENIZER_FILES = TOKENIZER_FILES


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tokenizer_files_sha256(path: str) -> Tuple[str, List[str]]:
    """The hash a shard records as ``tokenizer.files_sha256`` (over the tokenizer's files, by
    name and content) and the names hashed; ``path`` is a directory or a ``tokenizer.json``.
    Tools recompute it to tell whether a local tokenizer is the one a shard was made with."""
    path = os.path.abspath(path)
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    names = [n for n in _TOKENIZER_FILES if os.path.isfile(os.path.join(directory, n))]
    if not os.path.isdir(path):
        names = sorted(set(names) | {os.path.basename(path)})
    h = hashlib.sha256()
    for name in sorted(names):
        with open(os.path.join(directory, name), "rb") as f:
            h.update(name.encode() + b"\0" + _sha256(f.read()).encode())
    return h.hexdigest(), sorted(names)


def _divergence(full: str, before: str, after: str, k: int) -> str:
    """Where the rendering of messages ``[:k]`` (or ``[:k+1]``) first leaves the full one, in words."""
    part, name = (before, "the prompt before") if not full.startswith(before) else (after, "the rendering through")
    at = next((i for i, (a, b) in enumerate(zip(part, full)) if a != b), min(len(part), len(full)))
    return (f"{name} message {k} leaves it at character {at}: {part[at:at + 24]!r} where the whole "
            f"conversation has {full[at:at + 24]!r}")


class ChatTokenizer:
    """A local Hugging Face fast tokenizer plus the encoders the pipeline needs.

    Args:
        path: a directory with ``tokenizer.json`` (and usually ``tokenizer_config.json``),
            or a ``tokenizer.json`` file (its directory's config is used when present).
        chat_template: the template text to use instead of the tokenizer's own
            (``--chat-template``, resolved by :func:`resolve_chat_template`).
        template_date: ``YYYY-MM-DD``, the date a template that reads the clock renders
            (:attr:`reads_clock`); default: today's UTC date, taken once here.
        template_args: ``(name, value)`` switches the template reads (``--template-arg``:
            ``enable_thinking``, ``thinking``, ``thinking_mode``, ...), given to every rendering.

    Raises:
        ShardError: the path holds no loadable fast tokenizer.
    """

    def __init__(self, path: str, chat_template: Optional[str] = None, template_date: Optional[str] = None,
                 template_args: Tuple[Tuple[str, object], ...] = ()) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        require_extra("preprocess", "transformers", "tokenizers", "jinja2")
        from transformers import PreTrainedTokenizerFast

        self.path = os.path.abspath(path)
        directory = self.path if os.path.isdir(self.path) else os.path.dirname(self.path)
        if not os.path.exists(self.path):
            raise ShardError("tokenizer path does not exist", path=path, field="tokenizer",
                             hint="--tokenizer takes a local directory or a tokenizer.json file")
        try:
            if os.path.isdir(self.path):
                self.hf = PreTrainedTokenizerFast.from_pretrained(self.path, local_files_only=True)
            else:
                has_config = os.path.exists(os.path.join(directory, "tokenizer_config.json"))
                self.hf = (PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
                           if has_config else PreTrainedTokenizerFast(tokenizer_file=self.path))
        except (OSError, ValueError, TypeError) as exc:
            raise ShardError(f"cannot load a fast tokenizer ({exc.__class__.__name__}: {exc})",
                             path=path, field="tokenizer",
                             hint="point --tokenizer at a directory holding tokenizer.json") from None
        self.backend = self.hf._tokenizer
        self.directory = directory
        self.vocab_size = len(self.hf)
        self.eos_id = self.hf.eos_token_id
        self.bos_id = self.hf.bos_token_id
        self.pad_id = self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eos_id
        self.special_tokens = sorted(set(self.hf.all_special_tokens)
                                     | {t.content for t in self.hf.added_tokens_decoder.values() if t.special})
        self.named_templates = dict(self.hf.chat_template) if isinstance(self.hf.chat_template, dict) else {}
        own = self.hf.chat_template if isinstance(self.hf.chat_template, str) else self.named_templates.get("default")
        self.chat_template = chat_template if chat_template is not None else own
        self.compiled = compile_template(self.chat_template)
        self.template_kwargs = {k: v for k, v in self.hf.special_tokens_map.items() if isinstance(v, str)}
        self.reads_clock = reads_clock(self.chat_template)
        self.template_date = (check_template_date(template_date) if template_date else utc_today()) \
            if self.reads_clock else None
        self.clock = {"strftime_now": pinned_clock(self.template_date)} if self.reads_clock else {}
        self.template_kwargs.update(self.clock)
        self.template_args = dict(template_args)
        self.template_kwargs.update(self.template_args)
        self._traits: Optional[TemplateTraits] = None
        self._call_text = None
        #: how assistant turns end, and the check that every trained reply ends with its stop
        self.stops = Stops((lambda messages, tools=None: self.render(messages, tools=tools))
                           if self.chat_template is not None else None, self.special_tokens,
                           self.backend.token_to_id, self.hf.eos_token, self.path)

    # ---------------------------------------------------------------- identity

    def identity(self) -> dict:
        """Name, sha256 over the tokenizer's files, template hash, vocab size, special ids."""
        files_sha256, names = tokenizer_files_sha256(self.path)
        return {
            "name": self._declared_name(),
            "path": self.path,
            "files_sha256": files_sha256,
            "files": names,
            "chat_template_sha256": _sha256(self.chat_template.encode()) if self.chat_template else None,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "bos_id": self.bos_id,
            "pad_id": self.pad_id,
        }

    def _declared_name(self) -> str:
        config = os.path.join(self.directory, "tokenizer_config.json")
        try:
            name = load_json(config).get("name_or_path")
        except (OSError, ValueError, AttributeError):   # (a ShardError is a ValueError)
            name = None
        return name if isinstance(name, str) and name else os.path.basename(os.path.normpath(self.directory))

    # ---------------------------------------------------------------- encoders

    def render(self, messages, add_generation_prompt: bool = False, tools=None) -> str:
        """The chat template applied to message dicts (no tokenization); ``tools`` is passed only
        when given, so a conversation without tools renders exactly as before tools existed."""
        extra = {} if tools is None else {"tools": tools}
        if self.compiled is not None:
            return self.compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **extra, **self.template_kwargs)
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           chat_template=self.chat_template, **extra, **self.clock,
                                           **self.template_args)

    def render_conversation(self, conv: Conversation, add_generation_prompt: bool = False) -> str:
        return self.render(conv.template_messages, add_generation_prompt, conv.tools)

    @property
    def traits(self) -> TemplateTraits:
        """What the template renders (:func:`.rendering.probe`), asked once."""
        if self._traits is None:
            self._traits = probe(lambda messages, tools=None: self.render(messages, tools=tools))
        return self._traits

    @property
    def call_text(self):
        """For a template that writes tool calls as text (XML, key/value tags), the call text it
        writes for ``(name, arguments)`` (:func:`.call_text.call_renderer`); else None."""
        if self.traits.call_form != "text" or self.traits.tool_arguments is None:
            return None
        if self._call_text is None:
            self._call_text = call_renderer(lambda messages, tools=None: self.render(messages, tools=tools),
                                            self.traits.tool_arguments == "string")
        return self._call_text

    def prepare(self, messages, policy: LossPolicy, path: str, line: int) -> Conversation:
        """The conversation adapted to this template (:func:`.rendering.adapt`)."""
        conv = messages if isinstance(messages, Conversation) else \
            as_conversation(messages, path, line, SchemaOptions(reasoning_tags=tuple(policy.tags)))
        if conv.rendered is not None:
            return conv
        if conv.plain:  # role and content only: nothing to adapt
            conv.rendered = conv.messages
            return conv
        return adapt(conv, self.traits, policy, path, line)

    def require_template(self) -> None:
        if self.chat_template is None:
            raise ShardError("the tokenizer has no chat template", path=self.path, field="chat_template",
                             hint=TEMPLATE_HINT + self.names_hint())

    def names_hint(self) -> str:
        names = sorted(self.named_templates)
        return f" (this tokenizer's named templates: {', '.join(names)})" if names else ""

    def chat_text_and_spans(self, messages, loss_on: str, path: str, line: int,
                            policy: LossPolicy = DEFAULT_POLICY, read_back: Optional[list] = None
                            ) -> Tuple[str, List[Tuple[int, int]]]:
        """The full rendering and the character spans to train (reference: prefix renders), after
        the rendering check and the loss policy (``read_back``: as :func:`.rendering.check_rendered`
        takes it).

        Raises:
            InputError: the template rejects the conversation, renders some text of it nowhere,
                or does not render its prefixes as prefixes of the full conversation.
        """
        self.require_template()
        conv = self.prepare(messages, policy, path, line)
        turns = trained_turns(conv, loss_on, policy)
        if loss_on != "all":
            require_trainable(conv, turns, policy, path, line)
        notes: dict = {}
        try:
            full = self.render_conversation(conv)
            spans = [] if loss_on == "all" else self.prefix_spans(conv, turns, full, path, line,
                                                                  loss_on == "assistant", policy, notes)
            full, spans = self.stops.extend(conv.template_messages, full, spans, path, line)
        except ShardError:
            raise
        except Exception as exc:  # jinja2 TemplateError, raise_exception(), bad content types
            raise template_rejected(exc, path, line) from None
        dropped = notes.get("dropped", set())
        check_rendered(full, conv, [k for k in reasoning_turns(conv, loss_on, policy, turns) if k not in dropped],
                       policy, path, line, read_back, self.call_text)
        if loss_on == "all":
            return full, []
        return full, self.refined(full, spans, turns, conv, policy, path, line, notes)

    def refined(self, text: str, spans, turns, conv: Conversation, policy: LossPolicy, path: str, line: int,
                notes: Optional[dict] = None):
        """:func:`.policy.refine_spans`, skipped when it cannot cut anything: a conversation of plain
        messages (no content opens with reasoning) and a template whose source never writes the
        opening tag, so no block can open a turn or end its generation prompt (``notes``: what
        :meth:`prefix_spans` noted)."""
        if conv.plain and policy.tags[0] not in (self.chat_template or ""):
            return list(spans)
        notes = notes or {}
        return refine_spans(text, spans, turns, conv, policy, path, line, notes.get("opened", ()),
                            notes.get("dropped", ()))

    def turn_texts_and_spans(self, messages, path: str, line: int, policy: LossPolicy = DEFAULT_POLICY,
                             read_back: Optional[list] = None) -> List[Tuple[str, List[Tuple[int, int]]]]:
        """``per-turn``: for each trained turn k, the rendering of messages ``[:k+1]`` and its last
        turn's spans (``read_back``: as :func:`.rendering.check_rendered` takes it).

        Raises:
            InputError: as :meth:`chat_text_and_spans`; or no assistant turn.
        """
        conv = self.prepare(messages, policy, path, line)
        turns = trained_turns(conv, "assistant", policy)
        require_trainable(conv, turns, policy, path, line)
        if not turns:
            raise input_error("no token is trained: the conversation has no assistant turn", path, line,
                              field="loss_mask", reason="no_trainable_tokens",
                              hint="the conversation has no assistant turn (or the template hides it)")
        return [self.chat_text_and_spans(conv.cut(k), "last-turn", path, line, policy, read_back) for k in turns]

    def encode_chat(self, messages, loss_on: str, path: str, line: int, policy: LossPolicy = DEFAULT_POLICY
                    ) -> Tuple[np.ndarray, np.ndarray]:
        """Token ids and LABEL-ALIGNED loss mask of one conversation (``per-turn``: of its
        last assistant turn's sequence only; the pipeline uses :mod:`.encode`).

        Raises:
            InputError: no chat template, the template rejects the conversation
                (e.g. an unknown role), prefixes do not render consistently, or
                no token is trained.
        """
        if loss_on == "per-turn":
            full, spans = self.turn_texts_and_spans(messages, path, line, policy)[-1]
        else:
            full, spans = self.chat_text_and_spans(messages, loss_on, path, line, policy)
        enc = self.backend.encode(full, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)
        if loss_on == "all":
            trained = np.ones(ids.size, dtype=np.uint8)
            trained[:1] = 0
        else:
            trained = trained_from_offsets(np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)[:, 0], spans)
            self.stops.check(ids, trained, path, line, self.decode)
        return ids, label_aligned(trained, path, line)

    def prefix_spans(self, conv: Conversation, turns: List[int], full: str, path: str, line: int,
                     every_turn: bool = True, policy: LossPolicy = DEFAULT_POLICY, notes: Optional[dict] = None):
        """Reference spans of the assistant messages at ``turns`` (prefix renders).

        Two differences between a prefix and the full rendering are allowed, by rule, so that each
        turn is trained exactly as the conversation's one rendering shows it (docs/INPUTS.md,
        "Thinking templates"):

        * a generation prompt that opens a reasoning block (Qwen3.5's ``<think>\n``, GLM-4.7's
          ``<think>``, DeepSeek-R1's) the turn's rendering in the conversation omits: the opened
          block is counted as prompt -- the turn starts where the rendering shows it, after the
          prompt without its opening tag (``notes["opened"]`` gets the turn);
        * a reasoning block opening turn k when it ends the prefix, which the template renders
          otherwise once a later turn follows (Qwen3's and Qwen3.5's ``<think>..</think>`` shown
          for the final turn only; GLM-4.7's reduced to a bare closing tag): the turn's span is
          taken from the prefix with the block as the history shows it. An empty block is never
          trained under ``--empty-reasoning-loss mask`` (the default); a non-empty one is
          reasoning the template drops from the history: the turn is trained as rendered, without
          it (``notes["dropped"]`` gets the turn; the rendering check then does not ask for it).

        Raises:
            InputError: a prefix does not render as a prefix of ``full`` (the hint names the loss
                modes that work: with ``every_turn`` false, the last turn alone fails, so only
                ``all`` or another template can).
        """
        spans = []
        messages = conv.template_messages
        opening, closing = policy.tags
        for k in turns:
            before = (self.render(messages[:k], True, conv.tools) if k else self.empty_prefix(conv.tools))
            after = self.render(messages[:k + 1], False, conv.tools)
            if not full.startswith(before):
                head = without_opened_block(before, opening, closing)
                if head is not None and full.startswith(head):
                    before = head   # (the generation prompt's opened block, counted as prompt)
                    if notes is not None:
                        notes.setdefault("opened", set()).add(k)
            if len(before) <= len(after) and not full.startswith(after):
                edited = as_history(after, len(before), full, opening, closing)
                if edited is not None and (not edited[1] or policy.empty_reasoning == "mask"):
                    after = edited[0]
                    if not edited[1] and notes is not None:
                        notes.setdefault("dropped", set()).add(k)
            if not (full.startswith(before) and full.startswith(after) and len(before) <= len(after)):
                raise input_error("the chat template does not render conversation prefixes as prefixes "
                                  f"of the full conversation ({_divergence(full, before, after, k)}): its "
                                  "output for earlier turns depends on later ones (a system prompt or tool "
                                  "list placed by the last user turn, as Mistral's templates do, or reasoning "
                                  "dropped from the history, as thinking templates do), so every assistant "
                                  "turn cannot be trained from one rendering",
                                  path, line, field="chat_template", reason="template_error",
                                  hint=PREFIX_HINT if every_turn else LAST_TURN_HINT)
            end = len(after)
            while end > len(before) and after[end - 1].isspace():
                end -= 1
            spans.append((len(before), end))
        return spans

    def empty_prefix(self, tools=None) -> str:
        """What precedes an assistant turn that opens the conversation: the generation prompt alone
        (with the tool definitions when the conversation has them).

        Raises:
            Exception: with ``tools``, whatever the template raises (the caller reports it).
        """
        try:
            return self.render([], add_generation_prompt=True, tools=tools)
        except Exception:
            if tools is not None:
                raise
            return ""

    def encode_prompt(self, prompt: str, completion: str, path: str, line: int):
        """``[bos] prompt completion eos``; trained: the completion and EOS."""
        p = self.backend.encode(prompt, add_special_tokens=False).ids
        c = self.backend.encode(completion, add_special_tokens=False).ids
        head = [self.bos_id] if self.bos_id is not None else []
        tail = [self.eos_id] if self.eos_id is not None else []
        ids = np.asarray(head + p + c + tail, dtype=np.int64)
        trained = np.zeros(ids.size, dtype=np.uint8)
        trained[len(head) + len(p):] = 1
        return ids, label_aligned(trained, path, line)

    def decode(self, ids) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)


_LOADED: dict = {}


def load_chat_tokenizer(path: str, chat_template: Optional[str] = None,
                        template_date: Optional[str] = None, template_args=()) -> ChatTokenizer:
    """A ChatTokenizer shared within the process (and with workers forked after it loaded):
    a production tokenizer takes a second or more to load. Reloaded when its files change.
    ``path``: a local directory or ``tokenizer.json``, or a URL or Hugging Face name (loaded
    from this node's copy of its files, :func:`.tokenizer_source.local_tokenizer`)."""
    path = local_tokenizer(path)
    template_args = tuple(sorted(dict(template_args or ()).items()))
    key = (os.path.abspath(path), _files_state(path), chat_template, template_date, template_args)
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = ChatTokenizer(path, chat_template, template_date, template_args)
    return _LOADED[key]


def resolve_chat_template(value: str, tokenizer_path: str) -> str:
    """``--chat-template FILE|NAME``: the text of a Jinja file, or of one of the tokenizer's named
    templates (``tokenizer_config.json``'s list of ``{"name", "template"}``).

    Raises:
        ShardError: neither a readable file nor a named template of this tokenizer.
    """
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ShardError(f"cannot read the chat template ({exc.__class__.__name__}: {exc})", path=value,
                             field="chat_template", hint="--chat-template takes a UTF-8 Jinja file") from None
    tok = load_chat_tokenizer(tokenizer_path)
    if value in tok.named_templates:
        return tok.named_templates[value]
    names = sorted(tok.named_templates)
    raise ShardError(f"--chat-template {value!r} is neither a file nor a template of the tokenizer",
                     path=tokenizer_path, field="chat_template", actual=value,
                     hint=(f"its named templates are: {', '.join(names)}" if names else
                           "the tokenizer has no named templates; give the path of a Jinja file"))


def _files_state(path: str) -> tuple:
    directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    state = []
    for name in _TOKENIZER_FILES:
        try:
            st = os.stat(os.path.join(directory, name))
        except OSError:
            continue
        state.append((name, st.st_mtime_ns, st.st_size))
    return tuple(state)


def reasoning_turns(conv: Conversation, loss_on: str, policy: LossPolicy, turns: List[int]) -> List[int]:
    """The assistant turns whose reasoning the rendering must hold: the trained ones (under ``all``,
    the final one; a template may drop earlier turns' reasoning from the history it renders)."""
    return trained_turns(conv, "last-turn", policy) if loss_on == "all" else turns


def template_rejected(exc: BaseException, path: str, line: int):
    return input_error(f"the chat template rejected the conversation ({exc})", path, line,
                       field="messages", reason="template_error")
