"""The chat template compiled for rendering: transformers' own jinja setup, made cheaper to run.

Every conversation is rendered at least once, so what jinja does per lookup is paid per message.
:func:`compile_template` starts from transformers' compiled template (its sandbox, ``tojson``,
``raise_exception``, the ``{% generation %}`` tag) and keeps every character it renders, while:

* **inert generation blocks** are inlined (:func:`inline_generation`): a block whose body is
  output alone costs a macro call per assistant turn and changes no text;
* **attribute lookups on messages** (``message.content``) skip the exception: jinja's sandbox
  tries the attribute first, and on a dict that raises and catches an ``AttributeError`` per
  lookup before it reads the item. For a dict whose class has no attribute of that name and
  whose instances hold none of their own (no ``__dict__``, no ``__getattr__``), the item is
  what the sandbox returns, or its undefined when there is none: :func:`_item_lookup` reads it
  directly. Any other object, or a name the class has (``items``, ``get``), takes the sandbox's
  own path, with its safety checks;
* **the globals** are one dict: jinja keeps a template's as a ``ChainMap`` over the
  environment's and copies it key by key into every render's context;
* **``tojson`` without arguments** (``tool | tojson``: every tool definition and call's arguments)
  calls the C encoder ``json.dumps(x, ensure_ascii=False)`` builds, without building a
  ``JSONEncoder`` first (:func:`_tojson`): the same encoder with the same settings, so the same
  text or the same error; with any argument, transformers' own filter.

The lookups go through an overlay of transformers' environment (:func:`fast_environment`), so
its cached template and environment, shared with ``apply_chat_template``, stay as they are.
``tests/preprocess/test_template_compile.py`` renders both ways on every real family's template.
"""

from __future__ import annotations

import json
from typing import Dict, Optional


def compile_template(source: Optional[str]):
    """``source`` compiled by transformers' jinja setup, then again in :func:`fast_environment`
    (inert generation blocks inlined, lookups without exceptions, globals one dict); None when
    transformers' private helper is not there (the caller falls back to ``apply_chat_template``),
    transformers' own compiled template when jinja's internals are not what this expects."""
    if source is None:
        return None
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
        compiled = _compile_jinja_template(source)
    except Exception:  # a private helper: any change in transformers means the public path
        return None
    try:
        tree = inline_generation(compiled.environment, source)
        return recompile(compiled, source if tree is None else tree)
    except Exception:  # (jinja's internals changed: the template as transformers compiled it)
        return compiled


def recompile(compiled, source):
    """``source`` (a template's text, or a parsed tree) compiled in :func:`fast_environment` of
    ``compiled``'s environment, its globals one dict."""
    template = fast_environment(compiled.environment).from_string(source)
    template.globals = dict(template.globals)
    return template


def fast_environment(env):
    """An overlay of ``env`` (a sandboxed jinja environment) whose attribute lookup reads a plain
    dict's item without raising first (see the module docstring); ``env`` when it is one (a
    template compiled again, as the main pass's recorder is, shares its environment)."""
    if getattr(env, "_item_lookup", False):
        return env
    fast = env.overlay()
    fast.getattr = _item_lookup(fast, fast.getattr)
    own = fast.filters.get("tojson")
    if own is not None and json.encoder.c_make_encoder is not None:
        fast.filters = dict(fast.filters, tojson=_tojson(own))   # (the overlay's own: transformers' stays)
    fast._item_lookup = True
    return fast


def _item_lookup(env, sandboxed):
    """``env.getattr`` that reads an item directly where the sandbox would (``sandboxed``: its
    own method)."""
    names: Dict[type, object] = {}   # type -> its attribute names, or False: the sandbox's way
    undefined = env.undefined

    def getattr_(obj, attribute):
        cls = type(obj)
        own = names.get(cls)
        if own is None:
            own = names[cls] = _class_names(cls)
        if own is False or attribute in own:
            return sandboxed(obj, attribute)
        try:
            return obj[attribute]
        except LookupError:
            return undefined(obj=obj, name=attribute)

    return getattr_


def _tojson(own):
    """transformers' ``tojson`` filter (``own``), its argument-free call by the C encoder directly:
    :meth:`json.JSONEncoder.iterencode` builds this one for ``json.dumps(x, ensure_ascii=False)``
    (circular references checked, ``default`` raising ``TypeError``, NaN allowed; a string encoded
    as ``encode`` does, by ``encode_basestring``), a fresh one a call, as it does."""
    make, basestring, default = json.encoder.c_make_encoder, json.encoder.encode_basestring, json.JSONEncoder().default

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        if ensure_ascii is False and indent is None and separators is None and sort_keys is False:
            return "".join(make({}, default, basestring, None, ": ", ", ", False, False, True)(x, 0))
        return own(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    return tojson


def _class_names(cls):
    """Every attribute an instance of ``cls`` can have, when ``cls`` is a dict whose instances hold
    none of their own and look none up dynamically (then ``getattr`` fails exactly for a name not
    in it); else False."""
    if not issubclass(cls, dict):
        return False
    everything = dir(cls)
    if ("__dict__" in everything or "__getattr__" in everything
            or cls.__getattribute__ is not dict.__getattribute__):
        return False
    return frozenset(everything)


def inline_generation(env, source: str):
    """The parsed tree of ``source`` without the ``{% generation %}`` blocks that only wrap output,
    or None when it has none: the same text, rendered without a macro call per assistant turn
    (the blocks matter only to ``apply_chat_template(return_assistant_tokens_mask=True)``, which
    this project never asks of its compiled template; its masks come from prefix renders). A
    block goes only when its body is output alone (``{{ ... }}`` and text: no assignment, loop or
    macro whose scope the block's macro would bound, no ``caller``/``varargs``/``kwargs``) and
    the call takes no arguments; the tree is the parser's (``env``'s), after whitespace control,
    so trimming reads as it did."""
    if "endgeneration" not in source:   # (no block: add_generation_prompt alone is no reason to parse)
        return None
    from jinja2 import nodes   # (start-up: jinja2 loads with the template, not at import)
    from jinja2.visitor import NodeTransformer

    class _Inline(NodeTransformer):
        inlined = 0

        def visit_CallBlock(self, node):
            call = node.call
            if (isinstance(call, nodes.Call) and isinstance(call.node, nodes.ExtensionAttribute)
                    and call.node.name == "_generation_support" and not (call.args or call.kwargs
                                                                       or call.dyn_args or call.dyn_kwargs)
                    and not node.args and not node.defaults and node.body
                    and all(type(n) is nodes.Output for n in node.body)
                    and not any(n.name in ("caller", "varargs", "kwargs") for b in node.body
                                for n in b.find_all(nodes.Name))):
                self.inlined += 1
                return node.body
            return self.generic_visit(node)

    inline = _Inline()
    tree = inline.visit(env.parse(source))
    return tree if inline.inlined else None
