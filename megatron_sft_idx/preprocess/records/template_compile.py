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
  directly. An attribute of a built-in type (``content.strip``, ``message.get``) or of jinja's
  loop and namespace objects (``loop.last``, ``ns.flag``) is given by the sandbox's verdict on
  it, asked once per type and name: the verdict reads only the name and ``isinstance`` checks
  the type decides (a ``str.format`` reached by any name is still wrapped by the sandbox's own
  ``wrap_str_format``). Any other object, or a name of a dict subclass's class, takes the
  sandbox's own path, with its safety checks;
* **the globals** are one dict: jinja keeps a template's as a ``ChainMap`` over the
  environment's and copies it key by key into every render's context;
* **calls of built-in methods** (``content.strip()``, ``.split('</think>')``) skip the checks that
  cannot apply to them (:func:`_calls`): the sandbox asks any callable for ``unsafe_callable`` and
  ``alters_data``, and jinja for a ``pass_context`` mark on it and on its ``__call__``; a built-in
  method has none of them and cannot be given one (it holds no attributes), and whether it was
  safe to reach is decided where it was looked up (the sandbox's ``getattr``, unchanged). Any
  other callable (a macro, a filter's function, a ``str.format`` wrapper) takes jinja's way;
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
import types
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
    fast.call = _calls(fast, fast.call)
    own = fast.filters.get("tojson")
    if own is not None and json.encoder.c_make_encoder is not None:
        fast.filters = dict(fast.filters, tojson=_tojson(own))   # (the overlay's own: transformers' stays)
    fast._item_lookup = True
    return fast


#: built-in types whose instances hold no attributes of their own, and jinja's own objects a
#: template reads attributes of (``loop.index``, ``ns.flag``): the sandbox's verdict on an attribute
#: (``is_safe_attribute``: its name, and ``isinstance`` checks of the object, which its type decides)
#: is the same for every instance, so it is asked once a type and name
_VERDICT_TYPES = (str, dict, list, tuple, int, float, bool)


def _jinja_objects():
    from jinja2.runtime import LoopContext
    from jinja2.utils import Namespace
    return LoopContext, Namespace


def _item_lookup(env, sandboxed):
    """``env.getattr`` that reads an item directly where the sandbox would, and gives an attribute
    of the types above by the sandbox's verdict on its name, asked once (``sandboxed``: its own
    method, for everything else; its wrapping of ``str.format`` is applied to every value)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    kinds: Dict[type, tuple] = {}   # type -> (its attribute names or False, {name: verdict} or None)
    undefined, wrap, unsafe = env.undefined, env.wrap_str_format, env.unsafe_undefined
    stock = type(env).is_safe_attribute is ImmutableSandboxedEnvironment.is_safe_attribute
    jinja_objects = _jinja_objects()

    def kind_of(cls):
        names = _class_names(cls)
        cached = stock and (cls in _VERDICT_TYPES or issubclass(cls, jinja_objects))
        kinds[cls] = (names, {} if cached else None)
        return kinds[cls]

    def getattr_(obj, attribute):
        cls = type(obj)
        names, verdicts = kinds.get(cls) or kind_of(cls)
        if names is not False and attribute not in names:   # (getattr fails: the sandbox reads the item)
            if isinstance(obj, dict):
                try:
                    return obj[attribute]
                except LookupError:
                    return undefined(obj=obj, name=attribute)
            return sandboxed(obj, attribute)
        if verdicts is None:
            return sandboxed(obj, attribute)
        try:
            value = getattr(obj, attribute)
        except AttributeError:   # (a namespace without it: the sandbox's way, to its undefined)
            return sandboxed(obj, attribute)
        wrapped = wrap(value)   # (str.format's own sandboxing, whatever the name it is reached by)
        if wrapped is not None:
            return wrapped
        verdict = verdicts.get(attribute)
        if verdict is None:
            verdict = verdicts[attribute] = bool(env.is_safe_attribute(obj, attribute, value))
        return value if verdict else unsafe(obj, attribute)

    return getattr_


def _calls(env, sandboxed):
    """``env.call`` that calls a built-in method directly, as the sandbox and ``Context.call``
    would after their checks (``sandboxed``: the sandbox's own method, for anything else)."""
    builtin = types.BuiltinMethodType

    def call(__context, __obj, *args, **kwargs):
        if type(__obj) is not builtin:
            return sandboxed(__context, __obj, *args, **kwargs)
        if kwargs:   # (jinja's own, for a callable that takes the context: not a built-in)
            kwargs.pop("_block_vars", None)
            kwargs.pop("_loop_vars", None)
        try:
            return __obj(*args, **kwargs)
        except StopIteration:
            return env.undefined("value was undefined because a callable raised a StopIteration exception")

    return call


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
    """Every attribute an instance of ``cls`` can have, when ``cls`` is one of
    :data:`_VERDICT_TYPES` or a dict whose instances hold none of their own and look none up
    dynamically (then ``getattr`` fails exactly for a name not in it); else False."""
    if cls in _VERDICT_TYPES:
        return frozenset(dir(cls))
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
