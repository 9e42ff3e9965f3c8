#!/usr/bin/env python3
"""No production function over 80 lines (issue 46, item 5).

  check_function_length.py [ROOT]        checks the tree at ROOT (default: the repository); exit 1
                                         with one line per long function:
                                         FILE:LINE: function NAME is N lines (limit 80)
  check_function_length.py --self-test   plants long and short C++ and Python functions (with
                                         braces in strings, comments and raw strings, constructor
                                         initializer lists, a class with a long inline method, a
                                         long lambda) in a temporary tree and shows that exactly
                                         the long ones are reported; then checks the tree

A function's length runs from the first line of its signature (or `def`) to its closing brace (or
the last line of its body), both included. Checked: C++ sources (.h .cc .cpp .hpp .cu) under
server/, common/ and client/ (no tests/ folder), and Python under client/python/muon_offload/ and
client/examples/.

C++ is scanned, not compiled: comments, string and character literals (raw strings included) and
preprocessor lines are blanked first, then braces are matched. At namespace and class scope each
`{` that follows a parameter list (with its qualifiers, trailing return type or constructor
initializer list) opens a function: a namespace-scope function, an out-of-line method, a method
defined inside its class, or a lambda given a name at namespace or class scope. Everything inside
a function body (lambdas, local classes) counts as part of that function. Python is read with
`ast`: every function and method; a function nested in another counts as part of it.
"""
import ast
import os
import re
import sys
import tempfile

LIMIT = 80
CPP_ROOTS = ("server", "common", "client")
CPP_SUFFIXES = (".h", ".cc", ".cpp", ".hpp", ".cu")
PY_ROOTS = ("client/python/muon_offload", "client/examples")
SKIP_DIRS = {"tests", "test", "__pycache__"}


# ---- C++: blank what is not code ------------------------------------------------------------

RAW_PREFIXES = ("R", "u8R", "uR", "UR", "LR")


def blank_cpp(text):
    """The text with comments, literals and preprocessor lines blanked (newlines kept)."""
    out = list(text)
    n = len(text)
    i = 0
    line_start = True  # only whitespace since the last newline

    def blank(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if c == "\n":
            line_start = True
            i += 1
            continue
        if line_start and c == "#":  # a preprocessor line, with its continuations
            j = i
            while j < n:
                if text.startswith("/*", j):  # a comment may run past the line's end
                    end = text.find("*/", j + 2)
                    j = n if end < 0 else end + 2
                    continue
                if text[j] == "\n" and text[j - 1] != "\\":
                    break
                j += 1
            blank(i, j)
            i = j
            continue
        if not c.isspace():
            line_start = False
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            while j < n and text[j - 1] == "\\":  # a continued line comment
                k = text.find("\n", j + 1)
                j = n if k < 0 else k
            blank(i, j)
            i = j
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank(i, j)
            i = j
            continue
        if c == '"':
            word = identifier_before(text, i)
            if word in RAW_PREFIXES:
                open_paren = text.find("(", i)
                delim = text[i + 1:open_paren]
                close = text.find(")" + delim + '"', open_paren)
                j = n if close < 0 else close + len(delim) + 2
                blank(i, j)
                i = j
                continue
            j = end_of_quoted(text, i, '"')
            blank(i + 1, j - 1)  # the quotes stay: "..." is still one token
            i = j
            continue
        if c == "'":
            word = identifier_before(text, i)
            if word and word[0].isdigit():  # a digit separator: 1'000'000
                i += 1
                continue
            j = end_of_quoted(text, i, "'")
            blank(i + 1, j - 1)
            i = j
            continue
        i += 1
    return "".join(out)


def identifier_before(text, i):
    j = i
    while j > 0 and (text[j - 1].isalnum() or text[j - 1] == "_"):
        j -= 1
    return text[j:i]


def end_of_quoted(text, i, quote):
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == quote or text[j] == "\n":
            return j + 1
        j += 1
    return j


# ---- C++: find function bodies --------------------------------------------------------------

TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d[\w.']*|::|->|&&|\|\||<<|>>|\S")
QUALIFIERS = {"const", "noexcept", "override", "final", "mutable", "volatile", "try", "&", "&&",
              "constexpr", "consteval"}
SCOPE_KEYWORDS = {"class", "struct", "union", "enum", "namespace", "extern"}
NOT_NAMES = {"alignas", "decltype", "noexcept", "throw", "__attribute__", "sizeof", "requires",
             "if", "for", "while", "switch", "return"}
ACCESS = {"public", "private", "protected"}
MACRO = re.compile(r"[A-Z][A-Z0-9_]*_[A-Z0-9_]+$")


class Group:
    """A balanced (...), [...] or {...} inside a declaration's head."""

    def __init__(self, kind):
        self.kind = kind


def tokens_of(code):
    """[(token, offset)] of blanked code; one token per bracket."""
    return [(m.group(0), m.start()) for m in TOKEN.finditer(code)]


def find_functions(code):
    """[(name, first line, last line)] of the functions in blanked C++ code."""
    toks = tokens_of(code)
    line_of = LineIndex(code)
    found = []
    scopes = []  # the namespaces and classes we are in: their names (None: not a class)
    head = []  # the current declaration's head: [(token or Group, offset)]
    depth = 0  # brackets opened inside the head and not yet closed
    for_group = None
    i = 0
    while i < len(toks):
        tok, at = toks[i]
        i += 1
        if depth:  # inside a bracket of the head: it becomes one Group when closed
            if tok in "([{":
                depth += 1
            elif tok in ")]}":
                depth -= 1
                if not depth:
                    head.append((Group(for_group), head_start))
            continue
        if tok == ";" or tok == ":" and len(head) == 1 and head[0][0] in ACCESS:
            head = []
        elif tok == "}":
            if scopes:
                scopes.pop()
            head = []
        elif tok in "([":
            depth, for_group, head_start = 1, tok, at
        elif tok == "{":
            kind, name = classify(head)
            if kind == "function":
                end = matching_brace(toks, i - 1)
                last = toks[end][1] if end < len(toks) else len(code) - 1
                owner = "::".join(s for s in scopes if s)
                found.append((f"{owner}::{name}" if owner else name, line_of(head[0][1]),
                              line_of(last)))
                head = []
                i = end + 1
            elif kind == "scope":
                scopes.append(name)
                head = []
            else:  # an initializer's braces: part of the head
                depth, for_group, head_start = 1, tok, at
        else:
            head.append((tok, at))
    return found


def matching_brace(toks, i):
    depth = 0
    for j in range(i, len(toks)):
        if toks[j][0] == "{":
            depth += 1
        elif toks[j][0] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(toks)


def is_group(item, kind=None):
    return isinstance(item, Group) and (kind is None or item.kind == kind)


def classify(head):
    """('function', name), ('scope', None) or ('other', None) for a `{` that ends this head."""
    items = [t for t, _ in head]
    if not items:
        return "other", None
    items = strip_template(items)
    sig = items
    # A constructor's initializer list: SIG(...) QUALS : member(...), member{...}
    colon = next((k for k, t in enumerate(items) if t == ":" and k > 0
                  and any(is_group(x, "(") for x in items[:k])), None)
    if colon is not None:
        tail = items[colon + 1:]
        if tail and (is_group(tail[-1], "(") or is_group(tail[-1], "{")):
            sig = items[:colon]
        else:
            return "other", None  # `: member{` opens the member's braces
    sig = strip_qualifiers(strip_trailing_return(sig))
    if sig and is_group(sig[-1], "("):
        return "function", function_name(sig)
    if sig and is_group(sig[-1], "["):  # a lambda without parameters: name = [] {
        return "function", function_name(sig)
    keyword = next((k for k, t in enumerate(items) if isinstance(t, str) and t in SCOPE_KEYWORDS),
                   None)
    if keyword is not None and "=" not in items:
        if items[keyword] in ("namespace", "extern"):
            return "scope", None
        end = items.index(":") if ":" in items else None
        names = [t for t in items[keyword + 1:end]
                 if isinstance(t, str) and re.match(r"[A-Za-z_]", t) and t not in ("class", "final")]
        return "scope", names[-1] if names else None  # class MUOND_EXPORT Name final : Base
    return "other", None


def strip_template(items):
    """The head without leading `template <...>` parts."""
    while len(items) >= 2 and items[0] == "template" and items[1] == "<":
        depth = 0
        for k in range(1, len(items)):
            if items[k] == "<":
                depth += 1
            elif items[k] == ">":
                depth -= 1
            elif items[k] == ">>":
                depth -= 2
            if depth <= 0:
                items = items[k + 1:]
                break
        else:
            return items
    return items


def strip_trailing_return(items):
    for k in range(len(items) - 1, 0, -1):
        if items[k] == "->" and (is_group(items[k - 1]) or items[k - 1] in QUALIFIERS):
            return items[:k]
    return items


def strip_qualifiers(items):
    items = list(items)
    while items:
        last = items[-1]
        if isinstance(last, str) and last in QUALIFIERS:
            items.pop()
        elif is_group(last, "(") and len(items) >= 2 and items[-2] in NOT_NAMES:
            items = items[:-2]  # noexcept(...), throw(), __attribute__((...))
        elif is_group(last, "[") and len(items) >= 2 and is_group(items[-2], "["):
            items = items[:-2]  # [[attribute]]
        elif (is_group(last, "(") and len(items) >= 2 and isinstance(items[-2], str)
              and MACRO.match(items[-2]) and any(is_group(x, "(") for x in items[:-2])):
            items = items[:-2]  # an annotation: ABSL_LOCKS_EXCLUDED(mu_)
        else:
            break
    return items


def function_name(sig):
    """The name before the parameter list (`Class::Method`, `operator==`, `~Class`), or a
    lambda's variable."""
    k = len(sig) - 1  # the parameter list, or a lambda's captures
    if is_group(sig[k], "(") and k > 0 and is_group(sig[k - 1], "["):
        k -= 1
    if is_group(sig[k], "["):
        return lambda_name(sig[:k])
    j = k - 1
    if j >= 1 and is_group(sig[j], "(") and sig[j - 1] == "operator":
        parts, j = ["operator()"], j - 2
    elif j >= 1 and sig[j] in (">", ">>") and "operator" not in sig[:j]:
        j, args = skip_template_args(sig, j)  # a specialization: FromFloat<float>(float v)
        if j < 0 or not isinstance(sig[j], str) or not re.match(r"\w", sig[j]):
            return "anonymous"
        parts, j = [sig[j] + args], j - 1
    else:
        symbols = []
        while j >= 0 and isinstance(sig[j], str) and not re.match(r"\w", sig[j]):
            symbols.insert(0, sig[j])
            j -= 1
        if symbols and j >= 0 and sig[j] == "operator":  # operator==, operator<<, operator[]
            parts, j = ["operator" + "".join(symbols)], j - 1
        elif not symbols and j >= 0 and isinstance(sig[j], str) and re.match(r"\w", sig[j]):
            parts, j = [sig[j]], j - 1
            if j >= 0 and sig[j] == "~":
                parts, j = ["~" + parts[0]], j - 1
        else:
            return "anonymous"
    while j >= 1 and sig[j] == "::" and isinstance(sig[j - 1], str) and re.match(r"\w", sig[j - 1]):
        parts.insert(0, sig[j - 1])
        j -= 2
    return "::".join(parts)


def skip_template_args(sig, j):
    """(index before the `<` that the `>` at j closes, the text of <...>)."""
    depth, k = 0, j
    while k >= 0:
        t = sig[k]
        depth += {">": 1, ">>": 2, "<": -1}.get(t, 0) if isinstance(t, str) else 0
        if depth <= 0:
            break
        k -= 1
    text = "".join(t if isinstance(t, str) else t.kind + "..." for t in sig[k:j + 1])
    return k - 1, text


def lambda_name(before):
    """`auto kName = [` names its lambda kName."""
    for k in range(len(before) - 1, 0, -1):
        if before[k] == "=" and isinstance(before[k - 1], str) and re.match(r"\w", before[k - 1]):
            return before[k - 1]
    return "lambda"


class LineIndex:
    def __init__(self, text):
        self.starts = [m.end() for m in re.finditer("\n", text)]

    def __call__(self, offset):
        lo, hi = 0, len(self.starts)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.starts[mid] <= offset:
                lo = mid + 1
            else:
                hi = mid
        return lo + 1


def cpp_functions(path):
    with open(path, errors="replace") as f:
        text = f.read()
    return find_functions(blank_cpp(text))


# ---- Python ---------------------------------------------------------------------------------

def python_functions(path):
    """[(name, first line, last line)]: functions and methods; nested functions are part of the
    function that holds them."""
    with open(path, errors="replace") as f:
        tree = ast.parse(f.read(), filename=path)
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child.lineno, child.end_lineno))
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            elif not isinstance(child, ast.Lambda):
                visit(child, prefix)  # if/try blocks at module or class level

    visit(tree, "")
    return found


# ---- the check ------------------------------------------------------------------------------

def sources(root):
    """(relative path, language) of every production source checked."""
    for top, suffixes, lang in [(r, CPP_SUFFIXES, "cpp") for r in CPP_ROOTS] + \
                               [(r, (".py",), "py") for r in PY_ROOTS]:
        base = os.path.join(root, top)
        for dirpath, dirs, files in os.walk(base):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
            rel_dir = os.path.relpath(dirpath, root)
            if lang == "cpp" and rel_dir.startswith(os.path.join("client", "python")):
                continue  # the Python package's own C++ (none today) is its team's
            for name in sorted(files):
                if not name.endswith(suffixes):
                    continue
                if lang == "py" and (name.startswith("test_") or name.endswith("_test.py")):
                    continue
                yield os.path.join(rel_dir, name), lang


def check(root, limit=LIMIT):
    errors = []
    for rel, lang in sources(root):
        path = os.path.join(root, rel)
        functions = cpp_functions(path) if lang == "cpp" else python_functions(path)
        for name, first, last in functions:
            length = last - first + 1
            if length > limit:
                errors.append(f"{rel}:{first}: function {name} is {length} lines (limit {limit})")
    return errors


# ---- the self-test --------------------------------------------------------------------------

def body_lines(count, indent="  ", statement="x += {k};"):
    return "".join(f"{indent}{statement.format(k=k)}\n" for k in range(count))


def planted():
    """{relative path: text} and the reports expected of them."""
    files = {}
    expected = []
    # Long namespace-scope function with braces in strings, chars, comments and a raw string;
    # its length counts from the signature's first line (the return type on its own line).
    long_free = (
        "#include <string>\n"                                    # 1
        "#define OPEN {\n"                                       # 2
        "namespace a::b {\n"                                     # 3
        "// a comment with a brace {\n"                          # 4
        "static int\n"                                           # 5: first line
        "LongFree(int x,\n"                                      # 6
        "         int y) {\n"                                    # 7
        "  const char* s = \"}}}\\\"}\";\n"                      # 8
        "  char c = '}';\n"                                      # 9
        "  /* } } } */\n"                                        # 10
        "  const char* raw = R\"delim(}\" })delim\";\n"          # 11
        "  int big = 1'000'000;\n"                               # 12
        + body_lines(76) +                                       # 13..88
        "  return x;\n"                                          # 89
        "}\n"                                                    # 90: 86 lines
        "int Short() { return 1; }\n"                            # 91
        "}  // namespace a::b\n")
    files["server/x/long_free.cc"] = long_free
    expected.append("server/x/long_free.cc:5: function LongFree is 86 lines (limit 80)")
    # A constructor with an initializer list (braced and parenthesized members), an out-of-line
    # method and a short one; exactly 81 lines and exactly 80.
    ctor = (
        "#include \"x.h\"\n"                                      # 1
        "Widget::Widget(int a)\n"                                 # 2: first line
        "    : a_{a}, b_(a), c_{std::vector<int>{1, 2}} {\n"      # 3
        + body_lines(77) +                                        # 4..80
        "}\n"                                                     # 81: 80 lines, not reported
        "void Widget::Method(int k) const noexcept {\n"           # 82
        + body_lines(79) +                                        # 83..161
        "}\n"                                                     # 162: 81 lines
        "Widget::~Widget() {\n"                                   # 163
        + body_lines(10) +
        "}\n")
    files["common/ctor.cc"] = ctor
    expected.append("common/ctor.cc:82: function Widget::Method is 81 lines (limit 80)")
    # A class with a long inline method, a short one, a nested struct with a long method, an
    # operator, a lambda member and a long lambda inside a short function.
    klass = (
        "#pragma once\n"                                          # 1
        "template <class T, int N = (3 > 2)>\n"                   # 2
        "class Holder : public Base<T> {\n"                       # 3
        " public:\n"                                              # 4
        "  Holder() = default;\n"                                 # 5
        "  int Short() const { return 1; }\n"                     # 6
        "  std::vector<int> table_{1, 2, 3};\n"                   # 7
        "  template <typename U>\n"                               # 8: first line
        "  auto LongInline(U u) -> decltype(u + 1) {\n"           # 9
        "    auto f = [&](int z) { return z + u; };\n"            # 10
        + body_lines(85, "    ") +                                # 11..95
        "  }\n"                                                   # 96: 89 lines
        " private:\n"                                             # 97
        "  struct Inner {\n"                                      # 98
        "    bool operator==(const Inner& o) const {\n"           # 99
        + body_lines(81, "      ") +                              # 100..180
        "    }\n"                                                 # 181: 83 lines
        "  };\n"                                                  # 182
        "  static constexpr auto kLambda = [](int v) {\n"         # 183
        + body_lines(90, "    ", "v += {k};") +                   # 184..273
        "    return v;\n"                                         # 274
        "  };\n"                                                  # 275: 93 lines
        "};\n"                                                    # 276
        "inline void UsesLambda() {\n"                            # 277: 3 lines, its lambda too
        "  auto g = [] { return 1; };\n"
        "}\n")
    files["client/holder.h"] = klass
    expected += ["client/holder.h:8: function Holder::LongInline is 89 lines (limit 80)",
                 "client/holder.h:99: function Holder::Inner::operator== is 83 lines (limit 80)",
                 "client/holder.h:183: function Holder::kLambda is 93 lines (limit 80)"]
    # A long function in tests/ is not production code.
    files["server/tests/long_test.cc"] = "void T() {\n" + body_lines(100) + "}\n"
    files["client/tests/long_test.cc"] = "void T() {\n" + body_lines(100) + "}\n"
    # Python: a long method, a long function whose nested def is part of it, a short one, a
    # function under `if` at module level; a long test file is skipped.
    py = (
        "class Opt:\n"                                            # 1
        "    def __init__(self):\n"                               # 2
        "        s = '''def not_a_function():\n"                  # 3
        "        '''\n"                                           # 4
        + body_lines(85, "        ", "self.x{k} = {k}") +         # 5..89
        "\n"
        "    def short(self):\n"                                  # 91
        "        return 1\n"                                      # 92
        "\n"
        "\n"
        "def run_rank(rank):\n"                                   # 95
        "    def inner():\n"                                      # 96
        + body_lines(50, "        ", "y = {k}") +                 # 97..146
        "    inner()\n"                                           # 147
        + body_lines(40, "    ", "z = {k}") +                     # 148..187
        "    return rank\n"                                       # 188: 94 lines
        "\n"
        "if True:\n"                                              # 190
        "    def under_if():\n"                                   # 191
        + body_lines(81, "        ", "w = {k}") +                 # 192..272: 82 lines
        "\n")
    files["client/python/muon_offload/optim.py"] = py
    expected += ["client/python/muon_offload/optim.py:2: function Opt.__init__ is 88 lines "
                 "(limit 80)",
                 "client/python/muon_offload/optim.py:95: function run_rank is 94 lines "
                 "(limit 80)",
                 "client/python/muon_offload/optim.py:191: function under_if is 82 lines "
                 "(limit 80)"]
    files["client/examples/short.py"] = "def main():\n    return 0\n"
    files["client/python/muon_offload/tests/test_long.py"] = \
        "def test_long():\n" + body_lines(100, "    ", "a = {k}")
    return files, expected


def self_test():
    files, expected = planted()
    with tempfile.TemporaryDirectory(prefix="function-length-") as tmp:
        for rel, text in files.items():
            path = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        got = check(tmp)
    missing = [e for e in expected if e not in got]
    extra = [e for e in got if e not in expected]
    if missing or extra:
        print("self-test failed")
        for e in missing:
            print(f"  not reported: {e}")
        for e in extra:
            print(f"  reported but short or not production: {e}")
        print("got:\n  " + "\n  ".join(got))
        return 1
    print(f"self-test: the {len(expected)} planted long functions are reported, no short one")
    return 0


def main(argv):
    root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    if argv[1:2] == ["--self-test"]:
        if self_test():
            return 1
        argv = argv[:1] + argv[2:]
    if len(argv) > 1:
        root = argv[1]
    errors = check(root)
    for e in errors:
        print(e)
    if errors:
        print(f"{len(errors)} production function(s) over {LIMIT} lines")
        return 1
    print(f"function length: every production function is at most {LIMIT} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
