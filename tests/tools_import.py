"""Import a script of tools/ by path (tools/trace.py would otherwise meet the stdlib `trace`)."""
import importlib.util
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def tool(name: str):
    """tools/<name>.py as a module (tools/ goes on sys.path for its sibling imports)."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    key = f"prefix_reuse_tools_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, TOOLS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
