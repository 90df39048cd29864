"""Input shapes -> the chat template's message vocabulary, and what is refused (``docs/INPUTS.md``).

Every record kind is mapped here, once, into a :class:`Conversation` in Hugging Face
chat-template conventions, which public templates consume:

* roles ``system | user | assistant | tool``;
* assistant tool calls as ``tool_calls=[{"type": "function", "function": {"name", "arguments"}, "id"?}]``
  with ``arguments`` a dict (a JSON-object string is parsed; anything else is refused);
* tool results as ``{"role": "tool", "content", "tool_call_id"?, "name"?}``;
* a top-level ``tools`` list of ``{"type": "function", "function": {...}}`` (bare function schemas,
  as LLaMA-Factory's ShareGPT ``tools`` and OpenAI's legacy ``functions`` hold them, are wrapped);
* reasoning as ``reasoning_content`` (from ``reasoning_content`` / ``reasoning`` / ``thinking``, or
  written inline as ``<think>...</think>`` at the start of the content, or of a ShareGPT
  ``function_call`` value as LLaMA-Factory allows); where it goes in the rendering is decided
  per template by :mod:`..rendering`.

============  ================================================================================
kind          record
============  ================================================================================
chat          ``{"messages": [...], "tools"?, "functions"?, "system"?}`` (OpenAI / Hugging Face)
sharegpt      ``{"conversations": [{"from", "value"}...], "system"?, "tools"?}`` (LLaMA-Factory)
alpaca        ``{"instruction", "input"?, "output", "system"?, "history"?, "tools"?}``
xlam          ``{"query", "answers", "tools"}`` (xLAM / APIGen function calling: the calls and tools as
              JSON strings or lists)
nemotron      ``{"input": [messages], "output", "system_prompt"?, "tools"?}`` (Llama-Nemotron's
              post-training rows)
prompt        ``{PROMPT_KEY, COMPLETION_KEY}``: strings, or lists of messages (TRL conversational)
tokens        ``{"input_ids", "loss_mask" | "answer_start_idx"}``
============  ================================================================================

Nothing is dropped silently: a role, a message field, a content part or a tool call the run
cannot represent is an :class:`InputError` naming ``file:line`` and the field (a counted skip
under ``--skip-bad``). Record-level keys no shape uses (``id``, ``source``, ...) are metadata
and ignored; message-level keys are not (``--ignore-field NAME`` says one carries nothing the
model should see). ``None`` values count as absent (Parquet and Arrow rows hold every struct field).

The package, one module a shape:

==================  ===========================================================================
module              holds
==================  ===========================================================================
``registry``        how a shape is told (``--input-format auto``) and chosen; the kinds
``chat`` ...        one module a kind (``chat``, ``sharegpt``, ``alpaca``, ``xlam``, ``nemotron``,
                    ``prompt``, ``tokens``): the keys it reads and its mapping
``mapper``          what the mappings share: errors, texts, reasoning, tool calls, tools lists
``keys``            record-level keys: metadata, the ignore rules, the refusal of the rest
``base``            value helpers: absent values, text checks, nulls, inline reasoning
``conversation``    :class:`Conversation` and :class:`SchemaOptions`
``call_ids``        tool-call ids for a template that requires them in a fixed form (Mistral's)
==================  ===========================================================================
"""

from .base import check_json_texts, check_text, drop_nulls, split_inline_reasoning, surrogate_free, turns
from .chat import CHAT_ROLES, as_conversation
from .conversation import REASONING_TAGS, Conversation, SchemaOptions
from .keys import (APPLIED_RULES, CALL_ID_MINTED, CALL_ID_REPLACED, DECODED_TWICE, HISTORY_REASONING, IGNORE_RULES, METADATA_FLAGS, METADATA_KEYS, NO_TEXT_KEYS,
                   REASONING_SWITCHES, SYSTEM_KEYS, TRAINING_FLAGS, account_keys, ignore_rule)
from .mapper import Mapper
from .registry import KINDS, SHAPE_FIELDS, detect, map_record
from .sharegpt import SHAREGPT_ROLES
from .tokens import token_record

__all__ = ["APPLIED_RULES", "CALL_ID_MINTED", "CALL_ID_REPLACED", "CHAT_ROLES", "Conversation", "DECODED_TWICE", "HISTORY_REASONING", "IGNORE_RULES", "KINDS",
           "METADATA_FLAGS", "METADATA_KEYS", "Mapper", "NO_TEXT_KEYS", "REASONING_SWITCHES", "REASONING_TAGS",
           "SHAPE_FIELDS", "SHAREGPT_ROLES", "SYSTEM_KEYS", "TRAINING_FLAGS", "SchemaOptions", "account_keys", "as_conversation", "check_json_texts", "check_text",
           "detect", "drop_nulls", "ignore_rule", "map_record", "split_inline_reasoning", "surrogate_free",
           "token_record", "turns"]
