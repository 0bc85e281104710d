"""JSON schema -> GBNF, by the rules of the pinned llama-server (llama.cpp's ``common/json-schema.cpp`` and
``common/json-schema-to-grammar.cpp`` in llama-cpp-python 0.3.36's vendored tree), rewritten in Python: the
grammar text is the one llama-server builds for ``json_schema`` / ``response_format``, so constrained text at
temperature 0 is the text llama-server writes.

Two steps, as there: the schema is read into a small tree of typed nodes (:func:`read_schema`: ``$ref`` into
the same document, ``oneOf`` / ``anyOf``, a list of types, ``const``, ``enum``, ``allOf``, objects, tuples,
arrays, strings with a pattern / format / length, integers with bounds), then each node writes its rules
(:class:`_Converter`); the rules come out sorted by name. Differences from llama-cpp-python's older converter
(what ``llama_cpp.Llama`` uses): whitespace (``space``) may follow ``{`` / ``[`` / ``,`` and come before ``}`` /
``]``, ``"\\n"`` runs with indentation are whitespace too, integer bounds become digit ranges, repetitions stay
``{m,n}``, and a pattern the grammar cannot follow (``\\d``, lookarounds) means any string.

>>> print(json_schema_grammar({"type": "integer", "minimum": 1, "maximum": 12}), end="")
root ::= ([1-9] | "1" [0-2])
space ::= | " " | "\\n"{1,2} [ \\t]{0,20}
>>> print(json_schema_grammar({"properties": {"a": {"const": 1}}, "required": ["a"]}), end="")
a ::= "1"
a-kv ::= "\\"a\\"" space ":" space a
root ::= "{" space a-kv space "}"
space ::= | " " | "\\n"{1,2} [ \\t]{0,20}
"""
from __future__ import annotations

import itertools
from typing import Any

__all__ = ["json_schema_grammar", "read_schema", "SchemaError", "SPACE_RULE", "PRIMITIVE_RULES"]

from .schema_read import (SchemaError, Node, INT_MAX, I64_MIN, I64_MAX, MAX_PATTERN_DEPTH, read_schema)  # noqa: F401 - read_schema, SchemaError re-exported
from .schema_rules import (PRIMITIVE_RULES, STRING_FORMAT_RULES, SPACE_RULE, _INVALID_NAME, _Invalid, _NON_LITERAL, _REGEX_ONLY_ESCAPES, _RESERVED, _Unsupported, _dump, _escape_len, _int_range, _literal, _repetition, _stoi, _trie)  # noqa: F401


class _Converter:
    def __init__(self):
        self.rules: dict[str, str] = {"space": SPACE_RULE}
        self.resolving: set[str] = set()
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def add_rule(self, name: str, rule: str) -> str:
        esc = _INVALID_NAME.sub("-", name)
        if esc not in self.rules or self.rules[esc] == rule:
            self.rules[esc] = rule
            return esc
        i = 0
        while f"{esc}{i}" in self.rules and self.rules[f"{esc}{i}"] != rule:
            i += 1
        key = f"{esc}{i}"
        self.rules[key] = rule
        return key

    def add_primitive(self, name: str, key: str = "") -> str:
        """Rule ``name``: the primitive or string-format rule ``key`` (default ``name``), and the rules it uses."""
        rule, deps = PRIMITIVE_RULES.get(key or name) or STRING_FORMAT_RULES[key or name]
        n = self.add_rule(name, rule)
        for dep in deps:
            if dep not in self.rules:
                self.add_primitive(dep)
        return n

    def primitive(self, rule_name: str, t: str) -> str:
        return self.add_primitive("root" if rule_name == "root" else t, t)

    # -- patterns -----------------------------------------------------------------------------------------
    def visit_pattern(self, pattern: str, name: str) -> str:
        snapshot = dict(self.rules)
        try:
            return self.pattern_rule(pattern, name)
        except _Unsupported as e:
            self.rules = snapshot
            self.warnings.append(f"pattern {pattern} is not supported ({e}), accepting any string")
            return self.add_rule(name, self.add_primitive("string"))
        except _Invalid as e:
            self.rules = snapshot
            self.errors.append(f"Invalid pattern {pattern}: {e}")
            return ""

    def pattern_rule(self, pattern: str, name: str) -> str:
        if len(pattern) < 2 or pattern[0] != "^" or pattern[-1] != "$":
            raise _Unsupported("not anchored with '^' and '$'")
        sub = pattern[1:-1]
        n = len(sub)
        sub_ids: dict[str, str] = {}
        st = {"i": 0, "depth": 0}

        def to_rule(item: tuple[str, bool]) -> str:
            return '"' + item[0] + '"' if item[1] else item[0]

        def transform() -> tuple[str, bool]:
            seq: list[tuple[str, bool]] = []

            def join() -> tuple[str, bool]:  # (runs of literals as one literal)
                parts = []
                for is_lit, run in itertools.groupby(seq, key=lambda x: x[1]):
                    texts = [text for text, _ in run]
                    parts += ['"' + "".join(texts) + '"'] if is_lit else texts
                return " ".join(parts), False

            while st["i"] < n:
                i = st["i"]
                c = sub[i]
                if c == ".":  # (llama-server's converter never runs with dotall)
                    seq.append((self.add_rule("dot", r"[^\x0A\x0D]"), False))
                    st["i"] += 1
                elif c == "(":
                    st["i"] += 1
                    if sub.startswith("?", st["i"]):
                        if not sub.startswith("?:", st["i"]):
                            raise _Unsupported("unsupported group syntax")
                        st["i"] += 2
                    st["depth"] += 1
                    if st["depth"] > MAX_PATTERN_DEPTH:
                        raise _Unsupported("pattern nesting too deep")
                    seq.append(("(" + to_rule(transform()) + ")", False))
                elif c == ")":
                    st["i"] += 1
                    if st["depth"] == 0:
                        raise _Invalid("unbalanced parentheses")
                    st["depth"] -= 1
                    return join()
                elif c in "^$":
                    raise _Unsupported("anchor inside the pattern")
                elif c == "[":
                    cls = "["
                    i += 1
                    while i < n and sub[i] != "]":
                        k = _escape_len(sub, i) if sub[i] == "\\" else 1
                        if k == 0:
                            raise _Unsupported("unsupported escape in character class: " + sub[i:i + 2])
                        cls += sub[i:i + k]
                        i += k
                    if i >= n:
                        raise _Invalid("unterminated character class")
                    st["i"] = i + 1
                    seq.append((cls + "]", False))
                elif c == "|":
                    seq.append(("|", False))
                    st["i"] += 1
                elif c in "*+?":
                    if not seq:
                        raise _Invalid("nothing to repeat")
                    seq[-1] = (to_rule(seq[-1]) + c, False)
                    st["i"] += 1
                elif c == "{":
                    j = sub.find("}", i + 1)
                    if j < 0:
                        raise _Unsupported("unterminated curly brackets")
                    nums = sub[i + 1:j].split(",")
                    st["i"] = j + 1
                    if len(nums) not in (1, 2):
                        raise _Unsupported("wrong number of values in curly brackets")
                    try:
                        if len(nums) == 1:
                            lo = hi = _stoi(nums[0])
                        else:
                            lo, hi = _stoi(nums[0]) if nums[0] else 0, _stoi(nums[1]) if nums[1] else INT_MAX
                    except ValueError:
                        raise _Unsupported("invalid number in curly brackets") from None
                    if not seq:
                        raise _Invalid("nothing to repeat")
                    text, is_lit = seq[-1]
                    if not is_lit:
                        sid = sub_ids.get(text)
                        if sid is None:
                            sub_ids[text] = ""
                            sid = sub_ids[text] = self.add_rule(f"{name}-{len(sub_ids)}", text)
                        text = sid
                    seq[-1] = (_repetition('"' + text + '"' if is_lit else text, lo, hi, ""), False)
                else:
                    lit = ""
                    while i < n:
                        ch = sub[i]
                        if ch == "\\":
                            if i == n - 1:
                                raise _Invalid("trailing backslash")
                            plain = sub[i + 1] in _REGEX_ONLY_ESCAPES  # (the character itself)
                            k = 2 if plain else _escape_len(sub, i)
                            if k == 0:
                                raise _Unsupported("unsupported escape: " + sub[i:i + 2])
                            lit += sub[i + 1] if plain else sub[i:i + k]
                            i += k
                        elif ch == '"':
                            lit += '\\"'
                            i += 1
                        elif ch not in _NON_LITERAL and (i == n - 1 or not lit or sub[i + 1] == "."
                                                         or sub[i + 1] not in _NON_LITERAL):
                            lit += ch
                            i += 1
                        else:
                            break
                    if not lit:
                        raise _Unsupported("unsupported character: " + c)
                    st["i"] = i
                    seq.append((lit, True))
            return join()

        rule = to_rule(transform())
        if st["depth"] != 0:
            raise _Invalid("unbalanced parentheses")
        return self.add_rule(name, r'"\"" (' + rule + r') "\""')

    def not_strings(self, strings: list[str]) -> str:
        """A JSON string that is none of ``strings`` (llama.cpp's trie rule, its quirks kept)."""
        trie = _trie(strings)
        char = self.add_primitive("char")
        out = ['["] ( ']

        def visit(node: dict) -> None:
            kids = sorted((ch, sub) for ch, sub in node.items() if ch)
            for k, (ch, sub) in enumerate(kids):
                out.append((" | [" if k else "[") + ch + "]")
                if set(sub) - {""}:  # more characters follow
                    out.append(" (")
                    visit(sub)
                    out.append(")")
                else:
                    out.append(" " + char + "+")
            if kids:
                out.append(' | [^"' + "".join(ch for ch, _ in kids) + "] " + char + "*")

        visit(trie)
        out.append(" )")
        if "" not in trie:
            out.append("?")
        out.append(' ["]')
        return "".join(out)

    # -- nodes ---------------------------------------------------------------------------------------------
    def resolve_ref(self, node: Node) -> str:
        frag = node.ref[node.ref.index("#") + 1:] if "#" in node.ref else node.ref
        ref_name = "ref" + _INVALID_NAME.sub("-", frag)
        if ref_name not in self.rules and node.ref not in self.resolving:
            if node.target is None:
                self.errors.append(f"Unresolved $ref {node.ref}")
                return ""
            self.resolving.add(node.ref)
            ref_name = self.visit(node.target, ref_name)
            self.resolving.discard(node.ref)
        return ref_name

    def object_rule(self, props: list, required: set, name: str, additional: "Node | None") -> str:
        req_props: list[str] = []
        opt_props: list[str] = []
        kv: dict[str, str] = {}
        names: list[str] = []
        pre = name + ("-" if name else "")
        for pname, pschema in props:
            prule = self.visit(pschema, pre + pname)
            kv[pname] = self.add_rule(pre + pname + "-kv", _literal(_dump(pname)) + ' space ":" space ' + prule)
            (req_props if pname in required else opt_props).append(pname)
            names.append(pname)
        if additional is not None:
            sub = pre + "additional"
            value = (self.visit(additional, sub + "-value") if additional.kind != "any"
                     else self.add_primitive("value"))
            key = (self.add_primitive("string") if not names
                   else self.add_rule(sub + "-k", self.not_strings(names)))
            kv["*"] = self.add_rule(sub + "-kv", key + ' ":" space ' + value)
            opt_props.append("*")
        if not req_props and not opt_props:
            return '"{" space "}"'
        rule = '"{" space ' + ' "," space '.join(kv[p] for p in req_props)
        if opt_props:
            rule += " ("
            if req_props:
                rule += ' "," space ( '

            def rest(ks: list[str], first_optional: bool) -> str:
                if not ks:
                    return ""
                k = ks[0]
                comma = '( "," space ' + kv[k] + " )"
                if first_optional:
                    res = comma + ("*" if k == "*" else "?")
                else:
                    res = kv[k] + (" " + comma + "*" if k == "*" else "")
                if len(ks) > 1:
                    res += " " + self.add_rule(pre + k + "-rest", rest(ks[1:], True))
                return res

            rule += " | ".join(rest(opt_props[i:], False) for i in range(len(opt_props)))
            if req_props:
                rule += " )"
            rule += " )?"
        return rule + ' space "}"'

    def visit_all_of(self, node: Node, name: str, rule_name: str) -> str:
        required: set[str] = set()
        props: list = []
        enums: dict[str, int] = {}

        def add(comp: Node, is_required: bool) -> None:
            if comp.kind == "ref":
                if comp.target is not None:
                    add(comp.target, is_required)
            elif comp.kind == "object":
                for pname, pschema, _ in comp.properties:
                    props.append((pname, pschema))
                    if is_required:
                        required.add(pname)
            elif comp.kind == "enum":
                for v in comp.values:
                    r = _literal(_dump(v))
                    enums[r] = enums.get(r, 0) + 1

        for child in node.children:
            if child.kind == "anyOf":
                for alt in child.children:
                    add(alt, False)
            else:
                add(child, True)
        if enums:
            both = [r for r, k in sorted(enums.items()) if k == len(node.children)]
            if both:
                return self.add_rule(rule_name, "(" + " | ".join(both) + ")")
        return self.add_rule(rule_name, self.object_rule(props, required, name, None))

    def visit(self, node: Node, name: str) -> str:
        rule_name = name + "-" if name in _RESERVED else (name or "root")
        sub = name + ("-" if name else "")
        k = node.kind
        if k == "ref":
            return self.add_rule(rule_name, self.resolve_ref(node))
        if k == "anyOf":
            alts = [self.visit(c, name + ("-" if name else "alternative-") + str(i))
                    for i, c in enumerate(node.children)]
            return self.add_rule(rule_name, " | ".join(alts))
        if k == "allOf":
            return self.visit_all_of(node, name, rule_name)
        if k == "const":
            return self.add_rule(rule_name, _literal(_dump(node.value)))
        if k == "enum":
            return self.add_rule(rule_name, "(" + " | ".join(_literal(_dump(v)) for v in node.values) + ")")
        if k == "object":
            if not node.properties and node.additional is not None and node.additional.kind == "any":
                return self.add_rule(rule_name, self.add_primitive("object"))
            required = {p for p, _, req in node.properties if req}
            return self.add_rule(rule_name, self.object_rule([(p, s) for p, s, _ in node.properties], required,
                                                             name, node.additional))
        if k == "tuple":
            items = ' "," space '.join(self.visit(x, f"{sub}tuple-{i}") for i, x in enumerate(node.items))
            return self.add_rule(rule_name, '"[" space ' + items + ' space "]"')
        if k == "array":
            if node.items.kind == "any" and node.min_items == 0 and node.max_items < 0:
                return self.primitive(rule_name, "array")
            item = self.visit(node.items, sub + "item")
            hi = INT_MAX if node.max_items < 0 else node.max_items
            return self.add_rule(rule_name, '"[" space ' + _repetition(item, node.min_items, hi, '"," space')
                                 + ' space "]"')
        if k == "string":
            if node.pattern:
                return self.visit_pattern(node.pattern, rule_name)
            if node.format == "uuid":
                return self.primitive(rule_name, "uuid")
            if node.format:
                prim = node.format + "-string"
                return self.add_rule(rule_name, self.add_primitive(prim))
            if node.min_length > 0 or node.max_length >= 0:
                char = self.add_primitive("char")
                hi = INT_MAX if node.max_length < 0 else node.max_length
                return self.add_rule(rule_name, r'"\"" ' + _repetition(char, node.min_length, hi) + r' "\""')
            return self.primitive(rule_name, "string")
        if k == "integer":
            if node.minimum == I64_MIN and node.maximum == I64_MAX:
                return self.primitive(rule_name, "integer")
            out = ["("]
            _int_range(node.minimum, node.maximum, out)
            out.append(")")
            return self.add_rule(rule_name, "".join(out))
        if k in ("number", "boolean", "null"):
            return self.primitive(rule_name, k)
        return self.add_rule(rule_name, self.add_primitive("value"))

    def grammar(self) -> str:
        if self.errors:
            raise SchemaError("JSON schema conversion failed:\n" + "\n".join(self.errors))
        return "".join(f"{k} ::= {v}\n" for k, v in sorted(self.rules.items(), key=lambda kv: kv[0].encode()))


def json_schema_grammar(schema: Any) -> str:
    """The GBNF grammar llama-server builds for JSON schema ``schema``; :class:`SchemaError` (a ValueError)
    with its message where it refuses the schema."""
    tree = read_schema(schema)
    conv = _Converter()
    conv.visit(tree, "")
    return conv.grammar()
