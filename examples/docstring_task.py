"""Write a prompt-tuning task from the .py files of this Python's standard library: each example's
input is a function's `def` line and the opening quotes of its docstring, its output the
docstring's first line. `python examples/docstring_task.py OUT.jsonl [--limit N]`; the examples are
in file order, so the same Python gives the same task."""
from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sysconfig


def examples(root: pathlib.Path, limit: int, max_chars: int):
    """(input, output) pairs from the functions with a one-line docstring summary under root."""
    count = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            summary = doc.strip().splitlines()[0].strip() if doc else ""
            if not summary or not summary.endswith("."):
                continue
            head = f"def {node.name}({ast.unparse(node.args)}):\n    \"\"\""
            if len(head) + len(summary) > max_chars:
                continue
            yield head, summary
            count += 1
            if count == limit:
                return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", help="where the .jsonl goes")
    parser.add_argument("--limit", type=int, default=2000, help="examples at most (default 2000)")
    parser.add_argument("--max-chars", type=int, default=90,
                        help="longest input + output, in characters (default 90: they must fit the model's context)")
    args = parser.parse_args()
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    with open(args.out, "w") as out:
        n = 0
        for head, summary in examples(root, args.limit, args.max_chars):
            out.write(json.dumps({"input": head, "output": summary}) + "\n")
            n += 1
    print(f"{n} examples from {root} in {args.out}")


if __name__ == "__main__":
    main()
