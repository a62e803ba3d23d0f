"""ComfyUI's progress bar on a node (the bar the frontend draws on it), for the nodes' long work."""

from __future__ import annotations


def executing_node() -> str | None:
    """The id of the node ComfyUI is executing in this context (None outside ComfyUI's executor)."""
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:
        return None
    ctx = get_executing_context()
    return ctx.node_id if ctx is not None else None


def progress_bar(total: int, node_id: str | None = None):
    """A ``comfy.utils.ProgressBar`` of ``total`` on node ``node_id`` (default: the executing one), or None outside
    ComfyUI. Its updates also stop the work between two updates when the user cancels the run."""
    try:
        import comfy.utils
    except ImportError:
        return None
    return comfy.utils.ProgressBar(total, node_id=node_id if node_id is not None else executing_node())


def progress_text(text: str, node_id: str | None = None) -> None:
    """``text`` shown on node ``node_id`` (default: the executing one) while it runs, as ComfyUI's own nodes show
    theirs; nothing outside ComfyUI's executor."""
    node_id = node_id if node_id is not None else executing_node()
    if node_id is None:
        return
    try:
        from server import PromptServer
    except ImportError:
        return
    server = getattr(PromptServer, "instance", None)
    if server is not None:
        server.send_progress_text(text, node_id)
