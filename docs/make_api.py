"""Generate docs/api.md, the API reference, from the package's docstrings.

    python docs/make_api.py            # rewrite docs/api.md
    python docs/make_api.py --check    # exit 1 if docs/api.md is out of date (tests/docs/test_docs.py does this)

What is listed: every module of ``lightning_async_pp``; in each, the names of ``__all__`` or, without it, every
class and function defined there whose name does not start with ``_``; for each class, its public methods and
properties defined in the class itself. Methods a class overrides from a base class outside this package
(Lightning's strategy hooks, ``torch.optim.Optimizer`` methods) are listed by name only, unless they carry a
docstring of their own. Docstrings are read from ``__doc__`` (never inherited), so the page depends only on
this package's source. Reference-style markup (``:class:`X```, double backquotes, ``Args:`` sections,
``Example::`` blocks) is turned into Markdown; code blocks from docstrings are fenced as ``text`` because they
are illustrations with free variables, not runnable snippets.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import re
import sys
from pathlib import Path

PACKAGE = "lightning_async_pp"
OUT = Path(__file__).resolve().parent / "api.md"
SKIP_MODULES = {f"{PACKAGE}.__main__"}
# What a user reaches for first; every other module follows alphabetically.
ORDER = [
    PACKAGE,
    f"{PACKAGE}.strategy",
    f"{PACKAGE}.module",
    f"{PACKAGE}.runtime.contract",
    f"{PACKAGE}.optim",
    f"{PACKAGE}.optim.muon",
    f"{PACKAGE}.optim.delay_corrected",
    f"{PACKAGE}.cli",
    f"{PACKAGE}.demos",
    f"{PACKAGE}.demos.gpt",
    f"{PACKAGE}.demos.data",
]
SECTIONS = ("Args", "Arguments", "Attributes", "Raises", "Returns", "Yields")
WIDTH = 100

HEADER = """# API reference

Generated from the docstrings by [`docs/make_api.py`](make_api.py); do not edit by hand. After changing a
docstring or a signature, run `python docs/make_api.py` (a test fails while this page is out of date).

Most users need only `AsyncPipelineStrategy` (or `strategy="async_pp"`), the pipeline contract on their
`LightningModule` ([user guide](user-guide.md)), and perhaps `Muon` and `DelayCorrected`. The rest is for
research (schedules, the simulator, delay profiles) and for contributors ([architecture](architecture.md)).
"""


def modules() -> list[str]:
    package = importlib.import_module(PACKAGE)
    names = [PACKAGE]
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{PACKAGE}."):
        if info.name not in SKIP_MODULES:
            names.append(info.name)
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(names, key=lambda n: (rank.get(n, len(ORDER)), n))


def public_names(module) -> list[str]:
    if hasattr(module, "__all__"):
        return [n for n in module.__all__ if not n.startswith("__")]
    out = []
    for name, obj in vars(module).items():
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if getattr(obj, "__module__", None) == module.__name__:
            out.append(name)
    return out


# --------------------------------------------------------------------------- docstring to Markdown

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc|math):`~?([^`]+)`")


def _inline(text: str) -> str:
    text = _ROLE.sub(lambda m: f"`{m.group(1).split('.')[-1] if m.group(0).count('~') else m.group(1)}`", text)
    return text.replace("``", "`")


def docstring_markdown(doc: str | None) -> str:
    if not doc:
        return "*(no docstring)*"
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    i = 0
    section_item = False
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        # A literal block: "text::" or ".. math::" / ".. code-block::", followed by indented lines.
        if stripped.endswith("::") and not stripped.startswith(".. note"):
            lead = stripped[:-2].rstrip()
            if lead.startswith(".. "):
                lead = ""
            if lead:
                out.append(_inline(lead) + ":")
            base = len(line) - len(line.lstrip())
            block: list[str] = []
            i += 1
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > base):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            while block and not block[0].strip():
                block.pop(0)
            indent = min((len(b) - len(b.lstrip()) for b in block if b.strip()), default=0)
            out += ["", "```text", *[b[indent:] for b in block], "```", ""]
            section_item = False
            continue
        if stripped.startswith(".. note::"):
            out.append("**Note:** " + _inline(stripped[len(".. note::") :].strip()))
            i += 1
            continue
        header = stripped.rstrip(":")
        if stripped.endswith(":") and header in SECTIONS and line == stripped:
            out += ["", f"**{header}:**", ""]
            section_item = True
            i += 1
            continue
        if section_item and line.startswith("    ") and stripped:
            depth = len(line) - len(line.lstrip())
            if depth == 4 and re.match(r"^[\w*]+( \([^)]*\))?:( |$)", stripped):
                name, _, rest = stripped.partition(":")
                out.append(f"- `{name}`: {_inline(rest.strip())}".rstrip())
            else:
                out[-1] = out[-1] + " " + _inline(stripped)
            i += 1
            continue
        if not stripped:
            section_item = False
            out.append("")
            i += 1
            continue
        if stripped.startswith("* "):
            stripped = "- " + stripped[2:]
        out.append(_inline(stripped) if line == line.lstrip() else "  " + _inline(stripped))
        i += 1
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


# --------------------------------------------------------------------------- signatures


def _clean(text: str) -> str:
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def _annotation(annotation) -> str:
    # With `from __future__ import annotations` annotations are the source text; show it unquoted.
    return annotation if isinstance(annotation, str) else _clean(inspect.formatannotation(annotation))


def _parameter(p: inspect.Parameter) -> str:
    text = p.name
    if p.kind is p.VAR_POSITIONAL:
        text = "*" + text
    elif p.kind is p.VAR_KEYWORD:
        text = "**" + text
    if p.annotation is not p.empty:
        text += f": {_annotation(p.annotation)}"
    if p.default is not p.empty:
        text += (" = " if p.annotation is not p.empty else "=") + _clean(repr(p.default))
    return text


def signature(name: str, obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return f"{name}(...)"
    params = []
    star = any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values())
    for p in sig.parameters.values():
        if p.name in ("self", "cls"):
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            params.append("*")
            star = True
        params.append(_parameter(p))
    ret = ""
    if sig.return_annotation is not inspect.Signature.empty and sig.return_annotation not in ("None", None):
        ret = f" -> {_annotation(sig.return_annotation)}"
    one_line = f"{name}({', '.join(params)}){ret}"
    if len(one_line) <= WIDTH:
        return one_line
    return f"{name}(\n" + "".join(f"    {p},\n" for p in params) + f"){ret}"


def _defined_here(cls, name: str) -> bool:
    for base in cls.__mro__[1:]:
        if base is object:
            continue
        if name in vars(base):
            return False
    return True


def class_members(cls) -> tuple[list[tuple[str, object, str]], list[str]]:
    """(documented members, overridden names listed without docs)."""
    members, overrides = [], []
    for name, raw in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(raw, property):
            kind, target = "property", raw.fget
        elif isinstance(raw, (classmethod, staticmethod)):
            kind, target = type(raw).__name__, raw.__func__
        elif inspect.isfunction(raw):
            kind, target = "method", raw
        else:
            continue
        own_doc = target.__doc__ if target is not None else None
        if not _defined_here(cls, name) and not own_doc:
            overrides.append(name)
            continue
        members.append((name, raw, kind))
    return members, sorted(overrides)


def render_class(qualname: str, cls) -> list[str]:
    out = [f"### class `{qualname}`", ""]
    bases = [b for b in cls.__bases__ if b is not object]
    if bases:
        out += ["Bases: " + ", ".join(f"`{b.__module__}.{b.__qualname__}`" for b in bases), ""]
    init_target = cls
    out += ["```text", signature(cls.__name__, init_target), "```", "", docstring_markdown(cls.__doc__), ""]
    members, overrides = class_members(cls)
    for name, raw, kind in members:
        if kind == "property":
            out += [f"#### `{cls.__name__}.{name}` (property)", "", docstring_markdown(raw.fget.__doc__), ""]
            continue
        func = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        sig = signature(f"{cls.__name__}.{name}", func)
        label = f" ({kind})" if kind != "method" else ""
        out += [
            f"#### `{cls.__name__}.{name}`{label}",
            "",
            "```text",
            sig,
            "```",
            "",
            docstring_markdown(func.__doc__),
            "",
        ]
    if overrides:
        base = next((b for b in cls.__mro__[1:] if b.__module__.split(".")[0] != PACKAGE and b is not object), None)
        where = f" `{base.__module__.split('.')[0]}` " if base is not None else " "
        out += [
            f"Overrides of{where}base-class methods, behaving as documented there: "
            + ", ".join(f"`{n}`" for n in overrides)
            + ".",
            "",
        ]
    return out


def render_function(qualname: str, func) -> list[str]:
    return [
        f"### `{qualname}`",
        "",
        "```text",
        signature(func.__name__, func),
        "```",
        "",
        docstring_markdown(func.__doc__),
        "",
    ]


def render() -> str:
    out = [HEADER]
    toc = []
    body: list[str] = []
    for modname in modules():
        module = importlib.import_module(modname)
        names = public_names(module)
        anchor = re.sub(r"[^\w\- ]", "", modname.lower())  # the heading's anchor on GitHub and in mkdocs
        toc.append(f"- [`{modname}`](#{anchor})")
        body += [f"## `{modname}`", "", docstring_markdown(module.__doc__), ""]
        reexports, own = [], []
        for name in names:
            obj = getattr(module, name)
            home = getattr(obj, "__module__", modname)
            (own if home == modname or not (inspect.isclass(obj) or inspect.isfunction(obj)) else reexports).append(
                (name, obj, home)
            )
        if reexports:
            body += ["Exports: " + ", ".join(f"`{n}` (from `{h}`)" for n, _, h in reexports) + ".", ""]
        for name, obj, _ in own:
            qual = f"{modname}.{name}"
            if inspect.isclass(obj):
                body += render_class(qual, obj)
            elif inspect.isfunction(obj):
                body += render_function(qual, obj)
            else:
                body += [f"### `{qual}`", "", "```text", f"{name} = {_clean(repr(obj))}", "```", ""]
    text = "\n".join(out + ["## Modules", "", *toc, "", *body])
    text = re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def undocumented() -> list[str]:
    """Public functions, classes, methods and properties without a docstring of their own."""
    missing = []
    for modname in modules():
        module = importlib.import_module(modname)
        for name in public_names(module):
            obj = getattr(module, name)
            if getattr(obj, "__module__", modname) != modname:
                continue
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and not obj.__doc__:
                missing.append(f"{modname}.{name}")
            if inspect.isclass(obj):
                for member, raw, kind in class_members(obj)[0]:
                    func = raw.fget if kind == "property" else getattr(raw, "__func__", raw)
                    if not func.__doc__:
                        missing.append(f"{modname}.{name}.{member}")
    return missing


def main() -> int:
    parser = argparse.ArgumentParser(description="Generate docs/api.md from the docstrings.")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md differs from the generated page")
    parser.add_argument("--undocumented", action="store_true", help="list public names without a docstring")
    args = parser.parse_args()
    if args.undocumented:
        print("\n".join(undocumented()))
        return 0
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is out of date: run python docs/make_api.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
