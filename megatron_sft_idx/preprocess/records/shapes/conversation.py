"""A conversation in the chat template's vocabulary, and the run's settings the mapping reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Tuple

REASONING_TAGS = ("<think>", "</think>")


@dataclass
class Conversation:
    """One conversation in the template's vocabulary, plus what the loss policy needs.

    ``messages`` hold only the keys that are set (templates test ``'tool_calls' in message``).
    ``fields`` name each message's source (``conversations[3]``, ``input``) for errors;
    ``untrained`` are messages the producer excluded from the loss (``weight: 0``, the prompt of a
    conversational prompt/completion record); ``inline`` maps an assistant message whose content
    opened with a reasoning block (even an empty one) to its content as written; ``rendered`` is
    set by :func:`megatron_sft_idx.preprocess.records.rendering.adapt`, which names in ``applied``
    each tool-call id it gave (:mod:`.call_ids`).
    """

    messages: List[dict]
    tools: Optional[List[dict]] = None
    fields: List = field(default_factory=list)   # a name, or an int i for "messages[i]" (formatted when needed)
    untrained: FrozenSet[int] = frozenset()
    inline: Dict[int, str] = field(default_factory=dict)
    rendered: Optional[List[dict]] = None   # the messages as the template is given them (rendering.adapt)
    plain: bool = False                     # every message is {"role", "content"} as given: nothing to adapt
    source_tools: object = None             # the record's tools value as given (accounting.check_rendered_tools)
    source_calls: tuple = ()                # each tool call as the record gives it (accounting.check_rendered_tools)
    applied: tuple = ()                     # rule:field per tool-call id given by rendering.adapt (.call_ids)

    @property
    def template_messages(self) -> List[dict]:
        return self.messages if self.rendered is None else self.rendered

    def where(self, k: int) -> str:
        """The source field of message ``k`` (``conversations[3]``, ``input``, ``messages[2]``)."""
        f = self.fields[k] if k < len(self.fields) else k
        return f if isinstance(f, str) else f"messages[{f}]"

    def with_rendered(self, rendered: List[dict]) -> "Conversation":
        """A copy with ``rendered`` set (``dataclasses.replace``'s result, without its walk of the
        fields: this runs once a record)."""
        new = object.__new__(Conversation)
        new.__dict__.update(self.__dict__)
        new.rendered = rendered
        return new

    def cut(self, k: int) -> "Conversation":
        """The conversation up to and including message ``k``, with the source calls its messages
        make (the record's calls are mapped one to one, in order)."""
        calls = sum(len(m.get("tool_calls") or ()) for m in self.messages[:k + 1])
        return Conversation(self.messages[:k + 1], self.tools, self.fields[:k + 1],
                            frozenset(i for i in self.untrained if i <= k),
                            {i: c for i, c in self.inline.items() if i <= k},
                            None if self.rendered is None else self.rendered[:k + 1], self.plain, self.source_tools,
                            self.source_calls[:calls])


@dataclass(frozen=True)
class SchemaOptions:
    """What the mapping needs from the run's settings."""

    prompt_key: str = "prompt"
    completion_key: str = "completion"
    prompt_format: str = "chat"          # chat | raw: how prompt/completion strings are encoded
    ignore_fields: Tuple[str, ...] = ()  # message fields that carry nothing the model should see
    reasoning_tags: Tuple[str, str] = REASONING_TAGS
