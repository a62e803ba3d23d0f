"""The backend names that are not one kernel of the registry, where every module of the pack can import them.

``sdpa`` names two things the code keeps apart: :data:`REFERENCE`, PyTorch's SDPA as a registry backend (the
reference, the end of every fallback chain, what ``auto`` measures every candidate against); and, in the node
layer, the backend a user picks to keep ComfyUI's own attention function (``nodes.hook.COMFYUI_OWN``, the same
string in saved workflows).
"""

REFERENCE = "sdpa"  # PyTorch's SDPA: the reference backend
AUTO = "auto"  # the fastest kernel per call shape within auto's gate, judged over the run (attention.auto)
AUTO_EXACT = "auto_exact"  # the fastest exact kernel per call shape (attention.auto, exact_only)
AUTO_FAST = "auto_fast"  # auto's earlier, looser gate, judged on the calls it times (attention.auto, AutoSelector.fast)
AUTOS = (AUTO, AUTO_EXACT, AUTO_FAST)
