"""The pack's files in ComfyUI's folders: the only place a prompt can make the pack read or write a file.

ComfyUI is often served on a network (``--listen``, a tunnel), so a file name in a prompt is untrusted, as core treats
it (``folder_paths``, SaveImage's common-path check).  Sparse-attention profiles live in the folder type
``sparge_profiles`` (``models/sparge_profiles`` by default; ``extra_model_paths.yaml`` may add folders under that key).

- **Reading** takes a name from the list of files in those folders (a COMBO input: core's prompt validation refuses a
  value not in the list before anything runs) and checks it again here: its real path, links followed, must lie inside
  one of the folders.
- **Writing** takes a plain file name (no folder, no separator, no ``..``, no control character, at most
  :data:`MAX_NAME` characters), writes into the first folder only, through a temporary file and an atomic rename, and
  never through a link.

Every refusal is a :class:`FileNameError` (a ValueError) naming the node and the rule, raised before any file is
opened.  What the pack reads and writes, and what a user on the network can make it do: ``docs/security.md``.
"""

from __future__ import annotations

import json
import os
import tempfile

FOLDER = "sparge_profiles"
EXTENSIONS = {".json"}
MAX_NAME = 200
NONE = "none"  # the list entry for "no profile"


class FileNameError(ValueError):
    pass


def register() -> None:
    """Register ``models/sparge_profiles`` with ComfyUI's folder_paths (once, at import of the pack); folders that
    ``extra_model_paths.yaml`` added under the same key stay, after the default one."""
    try:
        import folder_paths
    except ImportError:  # outside ComfyUI
        return
    default = os.path.join(folder_paths.models_dir, FOLDER)
    folder_paths.add_model_folder_path(FOLDER, default, is_default=True)
    paths, exts = folder_paths.folder_names_and_paths[FOLDER]
    folder_paths.folder_names_and_paths[FOLDER] = (paths, set(exts) | EXTENSIONS)


def folders() -> list[str]:
    """The profile folders, the default (where profiles are written) first."""
    try:
        import folder_paths
    except ImportError as e:
        raise FileNameError("profiles need ComfyUI's folder_paths (run inside ComfyUI)") from e
    register()
    return folder_paths.get_folder_paths(FOLDER)


def profile_names() -> list[str]:
    """The choices of a profile input: ``none`` and every profile file in the folders (refreshed with the node list)."""
    try:
        import folder_paths

        register()
        names = folder_paths.get_filename_list(FOLDER)
    except Exception:  # outside ComfyUI, or a folder that cannot be listed: the list is just `none`
        names = []
    return [NONE, *names]


def check_plain_name(name: str, node: str, what: str = "profile_name") -> str:
    """``name`` as a plain file name with ``.json``: a FileNameError naming ``node`` for anything else."""
    if not isinstance(name, str):
        raise FileNameError(f"{node}: {what} must be text, got {type(name).__name__}")
    name = name.strip(" ")
    bad = _why_bad(name)
    if bad:
        raise FileNameError(f"{node}: {what} {_show(name)} {bad}. Use a plain file name such as my_model; the file is "
                            f"written to models/{FOLDER}.")
    return name if name.lower().endswith(".json") else name + ".json"


def _unreadable(name: str) -> str | None:
    """Why no file can have this name (too long, a control character), for reading and writing alike."""
    if len(name) > MAX_NAME:
        return f"is longer than {MAX_NAME} characters"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "holds a control character"
    return None


def _why_bad(name: str) -> str | None:
    if not name:
        return "is empty"
    bad = _unreadable(name)
    if bad:
        return bad
    if "/" in name or "\\" in name or ":" in name:
        return "holds a folder separator or a drive (absolute paths and folders are not accepted)"
    if name.startswith("."):
        return "starts with a dot (names like .. or hidden files are not accepted)"
    if name.split(".")[0].upper() in _WINDOWS_RESERVED:
        return "is a name Windows reserves for a device"
    return None


_WINDOWS_RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}


def _show(name: str) -> str:
    text = name if len(name) <= 60 else name[:57] + "..."
    return repr(text)


def _inside(path: str, roots: list[str]) -> bool:
    real = os.path.realpath(path)
    for root in roots:
        r = os.path.realpath(root)
        try:
            if os.path.commonpath([real, r]) == r and real != r:
                return True
        except ValueError:  # another drive
            continue
    return False


def resolve_profile(name: str, node: str) -> str | None:
    """The real path of the listed profile ``name`` (None for ``none``/empty), checked to lie inside the profile folders
    with links followed; a FileNameError naming ``node`` otherwise, before the file is opened."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise FileNameError(f"{node}: profile must be text, got {type(name).__name__}")
    name = name.strip(" ")
    if name in ("", NONE):
        return None
    bad = _unreadable(name)
    if bad:
        raise FileNameError(f"{node}: profile {_show(name)} {bad}")
    if os.path.isabs(name) or name.startswith(("\\", "/")) or ":" in name or ".." in name.replace("\\", "/").split("/"):
        raise FileNameError(f"{node}: profile {_show(name)} is a path; choose a file from the list (the files in "
                            f"models/{FOLDER})")
    roots = folders()
    for root in roots:
        path = os.path.join(root, name)
        if os.path.lexists(path):
            if not _inside(path, roots):
                raise FileNameError(f"{node}: profile {_show(name)} leads outside models/{FOLDER} (a link); "
                                    "copy the file into the folder instead")
            if not os.path.isfile(path):
                raise FileNameError(f"{node}: profile {_show(name)} is not a file")
            return os.path.realpath(path)
    raise FileNameError(f"{node}: profile {_show(name)} is not in models/{FOLDER} (refresh the node list, R, after "
                        "adding files)")


def write_json(name: str, data: dict, node: str) -> str:
    """Write ``data`` as ``name`` (checked by :func:`check_plain_name`) into the default profile folder, atomically;
    the written path."""
    fname = check_plain_name(name, node)
    root = folders()[0]
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, fname)
    if os.path.islink(path):
        raise FileNameError(f"{node}: {fname} in models/{FOLDER} is a link; remove it or choose another name")
    if os.path.exists(path) and not os.path.isfile(path):
        raise FileNameError(f"{node}: {fname} in models/{FOLDER} is not a file; choose another name")
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=root)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
