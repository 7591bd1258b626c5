"""The examples a code prompt gives, run against an answer's code: doctests, `assert` lines and, where
unambiguous, `f(args) ==> value` lines.

- Doctests (`>>> f(1)` then the expected output) come from the stdlib `doctest` parser, per docstring of
  the prompt's code as written between its quotes (so `"a\\nb"` stays an escape), else over the prompt's
  text; a block the parser refuses (inconsistent indentation) is parsed `>>>` by `>>>`. A comparison with
  no output under it (`>>> f(x) == y`, as HumanEval writes some) is taken as an assertion.
- `assert ...` lines that parse as Python assert statements.
- Arrow lines, as HumanEval writes many of its examples: `f(1, 2) ==> 3`, `=>`, `->`, `➞`, `==`,
  `returns`, `should return`, `# => ...`. Taken only when unambiguous: the left side is a call of a
  function defined in the prompt's or the answer's code with literal arguments, and the right side is a
  Python literal (`true`/`false` read as booleans). A parenthesized right side that is not a tuple
  (`("Venus")`) is ambiguous, so it is left out, as is anything after a comment that is not a literal.

Only examples of a function the prompt's or the answer's code defines count: a prompt that merely shows
Python (`>>> 1 + 1`) has nothing to check the answer against. The examples run in `grading.sandbox`
after the solution (the prompt's code, then the answer's): doctest's own runner, whose output check
also accepts equal literal values (`[1,2]` for `[1, 2]`, `'a'` for `"a"`, floats within 1e-6).
"""

from __future__ import annotations

import ast
import doctest
import json
import re
import textwrap
from dataclasses import dataclass

from grading.answers import answer_code
from grading.graders import defines, extract_code
from grading.sandbox import SandboxResult, run_python

__all__ = [
    "Example",
    "defined_functions",
    "examples_program",
    "passes_prompt_examples",
    "prompt_code",
    "prompt_examples",
    "run_examples",
    "solution",
]

_PYTHON_TAGS = ("", "python", "python3", "py")
_SEPARATORS = ("# returns", "# =>", "# ->", "should return", "returns", "==>", "=>", "->", "➞", "==")
# A fence that opens a line: a prompt may name one inline ("reply in one ```python block") before its own.
_LINE_FENCE = re.compile(r"^[ \t]*```([\w+.-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.S | re.M)
_STRING = re.compile(r"""[rRuU]?('{3}|"{3}|'|")(.*)\1""", re.S)
_PREFIXES = re.compile(r"^(?:[*-]\s+|for\s+|assert\s+|example:\s*|e\.g\.\s*)", re.I)


@dataclass(frozen=True)
class Example:
    source: str  # Python: an expression or a statement
    want: str  # expected output, doctest's way ("" for a statement that must only not raise)
    kind: str  # doctest | assert | arrow


def prompt_code(prompt: str) -> str:
    """The Python of a prompt: its fenced Python blocks joined, else the prompt itself where it is Python that
    defines a function (a completion prompt); "" otherwise."""
    blocks = [code for tag, code in _LINE_FENCE.findall(prompt) if tag.lower() in _PYTHON_TAGS]
    if blocks:
        return "\n\n".join(blocks)
    return prompt if _is_python(prompt) and defined_functions(prompt) else ""


def defined_functions(code: str) -> set[str]:
    """Names of the top-level functions `code` defines (a regex where it does not parse: answers get cut off)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set(re.findall(r"^def\s+(\w+)\s*\(", code, re.M))
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def prompt_examples(prompt: str, functions: set[str]) -> list[Example]:
    """The examples `prompt` gives of the `functions` (see the module's docstring), in order, deduplicated."""
    code = prompt_code(prompt)
    found = [*_doctests(code or prompt, functions), *_asserts(prompt, functions), *_arrows(prompt, functions)]
    seen: set[str] = set()
    out = []
    for ex in found:
        key = ex.source.replace(" ", "")
        if key not in seen or ex.kind == "doctest":  # a doctest's setup lines may repeat
            seen.add(key)
            out.append(ex)
    return out


def _mentions(source: str, functions: set[str]) -> bool:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    return any(isinstance(n, ast.Name) and n.id in functions for n in ast.walk(tree))


def _doctests(text: str, functions: set[str]) -> list[Example]:
    """The doctest examples in `text` (source as written, so a docstring's `\\n` stays an escape), if one of
    them calls one of `functions`. `>>> f(x) == y` with no output under it is meant as an assertion."""
    parser = doctest.DocTestParser()
    examples = []
    for chunk in _docstrings(text):
        try:
            examples += parser.get_examples(chunk)
        except ValueError:  # inconsistent indentation: each `>>>` block on its own, dedented
            examples += [e for block in _blocks(chunk) for e in _safe_examples(parser, block)]
    if not any(_mentions(e.source, functions) for e in examples):
        return []
    return [_doctest(e.source.strip(), e.want) for e in examples]


def _docstrings(code: str) -> list[str]:
    """The docstrings of `code` as written between their quotes (escapes unexpanded); `code` itself where it
    is not Python."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return [code]
    out = []
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) or not body:
            continue
        first = body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            written = ast.get_source_segment(code, first.value) or ""
            match = _STRING.fullmatch(written)
            out.append(match.group(2) if match else first.value.value)
    return out


def _doctest(source: str, want: str) -> Example:
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError:
        node = None
    if not want.strip() and isinstance(node, ast.Compare):
        return Example(f"assert {source}", "", "doctest")
    return Example(source, want, "doctest")


def _blocks(text: str) -> list[str]:
    """`>>>` lines with the output lines under them, each block dedented."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if line.lstrip().startswith(">>>"):
            blocks.append([line.strip()])
        elif blocks and line.strip() and blocks[-1][-1] != "":
            blocks[-1].append(line.strip())
        elif blocks:
            blocks[-1].append("")
    return [textwrap.dedent("\n".join(b)) + "\n" for b in blocks]


def _safe_examples(parser: doctest.DocTestParser, block: str) -> list[doctest.Example]:
    try:
        return parser.get_examples(block)
    except ValueError:
        return []


def _asserts(prompt: str, functions: set[str]) -> list[Example]:
    out = []
    for line in prompt.splitlines():
        stripped = line.strip()
        if not stripped.startswith("assert "):
            continue
        try:
            tree = ast.parse(stripped)
        except SyntaxError:
            continue
        if isinstance(tree.body[0], ast.Assert) and _mentions(stripped, functions):
            out.append(Example(stripped, "", "assert"))
    return out


def _arrows(prompt: str, functions: set[str]) -> list[Example]:
    out = []
    for line in prompt.splitlines():
        stripped = line.strip()
        if stripped.startswith((">>>", "assert ")) and _is_python(stripped.removeprefix(">>>")):
            continue  # a doctest or a real assert: taken above
        example = _arrow(_PREFIXES.sub("", stripped), functions)
        if example is not None:
            out.append(example)
    return out


def _is_python(text: str) -> bool:
    try:
        ast.parse(text.strip())
    except SyntaxError:
        return False
    return True


def _arrow(line: str, functions: set[str]) -> Example | None:
    """`f(literals) SEP literal` as an example, or None where the line is not unambiguously one."""
    name = re.match(r"(\w+)\s*\(", line)
    if name is None or name.group(1) not in functions:
        return None
    for end in (m.end() for m in re.finditer(r"\)", line)):  # the shortest prefix that is a whole call
        call, rest = line[:end], line[end:].strip()
        if _literal_call(call):
            break
    else:
        return None
    for sep in _SEPARATORS:
        if rest.startswith(sep):
            value = _literal(rest[len(sep) :].strip())
            return None if value is None else Example(call, value, "arrow")
    return None


def _literal_call(source: str) -> bool:
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError:
        return False
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return False
    try:
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            ast.literal_eval(arg)
    except (ValueError, TypeError, MemoryError, RecursionError):
        return False
    return True


def _literal(text: str) -> str | None:
    """`text` as the repr of the Python literal it is (a trailing period or comment dropped); None if none."""
    candidates = [text, text.removesuffix("."), text.split(" #")[0].strip()]
    for candidate in candidates:
        if candidate in ("true", "false"):
            return repr(candidate == "true")
        try:
            value = ast.literal_eval(candidate)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if candidate.startswith("(") and not isinstance(value, tuple):
            return None  # `("Venus")`: a string, or a one-tuple missing its comma?
        return repr(value)
    return None


def solution(prompt: str, completion: str, functions: set[str]) -> str:
    """The code the examples run against: the prompt's code, then the answer's; an answer that gives only a
    body goes under the prompt's last signature (as `grading.graders` does for HumanEval)."""
    code_in_prompt = prompt_code(prompt)
    called = sorted(functions & defined_functions(code_in_prompt)) or sorted(functions)
    entry = called[-1] if called else ""
    code = extract_code(completion, entry) if entry else answer_code(completion)
    if entry and defines(code_in_prompt, entry) and not defines(code, entry):
        return code_in_prompt + textwrap.indent(textwrap.dedent(code), "    ")
    return f"{code_in_prompt}\n\n{code}" if code_in_prompt else code


_RUNNER = """

def __switchboard_examples(examples):
    import ast, doctest, math

    def same(a, b):
        if isinstance(a, bool) or isinstance(b, bool):
            return type(a) is type(b) and a == b
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    class Checker(doctest.OutputChecker):
        def check_output(self, want, got, optionflags):
            if super().check_output(want, got, optionflags | doctest.NORMALIZE_WHITESPACE):
                return True
            if want.strip() == "None" and not got.strip():  # the prompt shows what the shell hides
                return True
            try:
                return same(ast.literal_eval(want.strip()), ast.literal_eval(got.strip()))
            except Exception:
                return False

    class Runner(doctest.DocTestRunner):
        first = None

        def report_failure(self, out, test, example, got):
            why = f"expected {example.want.strip()!r}, got {got.strip()!r}"
            self.first = self.first or f"{example.source.strip()}: {why}"

        def report_unexpected_exception(self, out, test, example, exc_info):
            why = f"{exc_info[0].__name__}: {exc_info[1]}"[:200]
            self.first = self.first or f"{example.source.strip()}: raised {why}"

    parsed = [doctest.Example(source, want) for source, want in examples]
    test = doctest.DocTest(parsed, dict(globals()), "examples", None, 0, None)
    runner = Runner(checker=Checker(), optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    result = runner.run(test, out=lambda _text: None, clear_globs=False)
    if result.failed:
        raise SystemExit(f"{result.failed} of {result.attempted} examples fail; first: {runner.first}")


__switchboard_examples(json.loads(__SWITCHBOARD_EXAMPLES))
"""


def examples_program(code: str, examples: list[Example]) -> str:
    """`code`, then a doctest run of `examples` that exits non-zero (naming the first failure) if one fails."""
    payload = json.dumps([[e.source + "\n", e.want] for e in examples])
    return f"{code}\n\nimport json\n__SWITCHBOARD_EXAMPLES = {payload!r}\n{_RUNNER}"


def run_examples(code: str, examples: list[Example], *, timeout: float = 10.0) -> SandboxResult:
    return run_python(examples_program(code, examples), timeout=timeout)


def passes_prompt_examples(prompt: str, answer: str, *, timeout: float = 10.0) -> bool | None:
    """Whether `answer`'s code passes the examples `prompt` gives (as the `prompt_examples` verifier runs them, in
    the jail); None where there is nothing to run (no examples of a function the prompt or the answer defines) or
    no jail to run it in: a judge decides then. A run that times out fails."""
    from grading.sandbox import JailUnavailable

    functions = defined_functions(prompt_code(prompt)) | defined_functions(answer_code(answer))
    examples = prompt_examples(prompt, functions)
    if not examples:
        return None
    try:
        return run_examples(solution(prompt, answer, functions), examples, timeout=timeout).passed
    except JailUnavailable:
        return None
