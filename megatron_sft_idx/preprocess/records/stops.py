"""Stops: the token a trained reply ends on, so the model learns to stop (docs/INPUTS.md, "Stops").

A template ends an assistant turn in one of :data:`STOP_RULES`, decided by :func:`stop_rule` on a
probe conversation before anything is tokenized: with a special token of its own (``end-token``:
``<|im_end|>``, ``<|eot_id|>``, MiniMax's ``[e~[``), or with nothing, the next message's role token
being the stop (``next-role``: GLM's ``<|user|>``, ``<|observation|>``), the tokenizer's
end-of-sequence token appended after a rendering that ends with an assistant turn. A template whose
turns end with neither is refused up front (:meth:`Stops.require`). :meth:`Stops.extend` puts each
turn's stop inside its span under ``next-role``; :meth:`Stops.check` proves on every record that
each run of trained tokens ends with a special token, so a shard whose trained reply has no trained
stop is never written.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ...errors import ShardError
from .errors import input_error

#: how an assistant turn's stop is rendered: ``end-token``, the turn's own rendering ends with a
#: special token; ``next-role``, it ends with no token of its own and the next message's role token
#: (a special token) is the stop, the tokenizer's end-of-sequence token appended after the last turn
STOP_RULES = ("end-token", "next-role")

_PROBE = [{"role": "user", "content": "xqprobe ask"}, {"role": "assistant", "content": "xqprobe answer"},
          {"role": "user", "content": "xqprobe again"}, {"role": "assistant", "content": "xqprobe final"}]


def stop_rule(render, special_at, eos: Optional[str]) -> Optional[str]:
    """The :data:`STOP_RULES` entry the template behind ``render(messages, tools=None)`` follows,
    decided on a probe conversation before anything is tokenized; None when its assistant turns
    end with nothing a model could stop on (no token of their own, and no special token next or
    no special end-of-sequence token to append). ``special_at(text, i)``: the special token
    ``text`` holds at ``i``, or None; ``eos``: the tokenizer's end-of-sequence token, if special."""
    try:
        text = render(_PROBE)
    except Exception:  # (roles must alternate otherwise, say): the records' own renderings decide
        return "end-token"
    end = text.rfind("xqprobe final")
    if end < 0 or text[end + len("xqprobe final"):].strip():
        return "end-token"   # (the turn renders its own end; every record's stops are verified)
    gap = text.find("xqprobe answer") + len("xqprobe answer")
    while gap < len(text) and text[gap].isspace():
        gap += 1
    return "next-role" if eos is not None and special_at(text, gap) else None


class Stops:
    """The stops of one tokenizer and template.

    Args:
        render: ``render(messages, tools=None) -> str``, the template (None: no template; the
            rule is then ``end-token``, as prompt/completion records end with ``eos``).
        special_tokens: the tokenizer's special tokens (texts).
        ids_of: ``token -> id or None``.
        eos: the tokenizer's end-of-sequence token, or None.
        path: the tokenizer's path (named in errors).
    """

    def __init__(self, render: Optional[Callable], special_tokens: Sequence[str], ids_of, eos: Optional[str],
                 path: str) -> None:
        self._render, self.path = render, path
        self.eos = eos if eos in special_tokens else None
        self._specials = sorted(special_tokens, key=len, reverse=True)
        #: the ids a trained reply may end on (its stop): the special tokens. A set: a record's few
        #: run ends are looked up one by one (7 us a record), where ``np.isin`` hashed the ~1,200
        #: special ids of a 129k vocabulary again on every record (29 us, a tenth of a chat record)
        self.ids = frozenset({ids_of(t) for t in special_tokens} - {None})
        self._sorted_ids = np.asarray(sorted(self.ids), dtype=np.int64)   # (for a batch's run ends at once)
        self._rule: Optional[Tuple[Optional[str]]] = None

    @property
    def rule(self) -> Optional[str]:
        """How the template ends an assistant turn (:data:`STOP_RULES`), asked once before anything
        is tokenized; None: it ends turns with nothing to stop on."""
        if self._rule is None:
            self._rule = (stop_rule(self._render, self.special_at, self.eos),) if self._render is not None \
                else ("end-token",)
        return self._rule[0]

    def special_at(self, text: str, i: int) -> Optional[str]:
        """The special token ``text`` holds at ``i`` (the longest), or None."""
        for token in self._specials:
            if text.startswith(token, i):
                return token
        return None

    def require(self) -> None:
        """Raises ShardError when the template's assistant turns end with nothing to stop on."""
        if self.rule is None:
            raise ShardError("the chat template ends an assistant turn with no end token, and neither a special "
                             "token follows it nor does the tokenizer declare a special end-of-sequence token to "
                             "append: a model trained on it would never learn to stop", path=self.path,
                             field="chat_template", rule="template_no_stop",
                             hint="use a chat template whose assistant turns end with an end-of-turn token "
                                  "(--chat-template), or a tokenizer whose eos_token is a special token")

    def extend(self, messages: List[dict], full: str, spans, path: str, line: int):
        """``(full, spans)`` with each turn's stop inside its span under the ``next-role`` rule: the
        next role's token the rendering shows after the turn, or the end-of-sequence token appended
        after a rendering that ends with an assistant turn (``messages``: what was rendered).
        Unchanged under ``end-token``.

        Raises:
            InputError: a trained turn followed by no special token.
        """
        if self.rule != "next-role":
            return full, spans
        if messages and messages[-1].get("role") == "assistant":
            full = full.rstrip() + self.eos
        out = []
        for a, b in spans:
            i = b
            while i < len(full) and full[i].isspace():
                i += 1
            token = self.special_at(full, i)
            if token is None:
                raise input_error("an assistant turn ends with no stop: the template renders no end token after "
                                  "it and no special token follows it", path, line, field="chat_template",
                                  reason="template_error", hint="use a chat template with an end-of-turn token "
                                  "(--chat-template), or pass --skip-bad")
            out.append((a, i + len(token)))
        return full, out

    def check(self, ids: np.ndarray, trained: np.ndarray, path: str, line: int, decode) -> None:
        """Every run of trained tokens (token-aligned ``trained``) ends with a stop: a special token
        (the turn's end token, or the next role's). Made on every record; ``decode(ids) -> str``
        names the token otherwise.

        Raises:
            InputError: a trained reply that ends otherwise (reason ``template_error``).
        """
        t = trained.astype(bool, copy=False)
        ends = np.flatnonzero(t[:-1] > t[1:]).tolist()   # (a trained token before an untrained one)
        if t.size and t[-1]:
            ends.append(t.size - 1)
        stops = self.ids
        bad = [e for e in ends if int(ids[e]) not in stops]
        if bad:
            raise input_error(f"a trained reply ends with {decode(ids[bad[0]:bad[0] + 1])!r}, not a stop token: "
                              "the model would not learn to stop", path, line, field="loss_mask",
                              reason="template_error",
                              hint="use a chat template whose assistant turns end with an end-of-turn token "
                                   "(--chat-template), or pass --skip-bad")

    def unstopped(self, ids: np.ndarray, trained: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Per text of a batch (``ids`` and token-aligned ``trained`` of every text, text ``k`` at
        ``offsets[k]:offsets[k + 1]``): whether a run of its trained tokens ends on a token that is
        no stop -- the texts :meth:`check` refuses, found for the whole batch in a few array
        operations, where a record's own check makes five numpy calls. The caller checks the
        flagged texts with :meth:`check`, for its error."""
        t = trained.view(np.bool_) if trained.dtype == np.uint8 else trained.astype(bool)
        later = np.zeros(t.size, dtype=np.bool_)   # the next token of the same text is trained
        later[:-1] = t[1:]
        sizes = np.diff(offsets)
        later[offsets[1:][sizes > 0] - 1] = False
        ends = np.flatnonzero(t & ~later)
        stops, last = self._sorted_ids, ids[ends]
        at = np.searchsorted(stops, last)
        bad = ends[(at == stops.size) | (stops[np.minimum(at, stops.size - 1)] != last)] if stops.size else ends
        flags = np.zeros(sizes.size, dtype=np.bool_)
        flags[np.searchsorted(offsets, bad, "right") - 1] = True
        return flags
