"""One vLLM process's plugin set-up, as vLLM does it on a platform, in a fresh interpreter: ``python
platform_probe.py PLATFORM ROLE`` prints one JSON line of what the plugin imported and changed.

``PLATFORM``: ``cuda`` (vLLM's ``CudaPlatform`` made current on this CPU machine; the stand-ins: the CUDA build's
compiled modules the imports reach, :data:`COMPILED_CUDA_MODULES`, and an H100's answers to device queries), ``cpu``
(the CPU build as it is) or ``native`` (whatever this machine is, no stand-in: on a GPU host, a real CUDA process).
``ROLE``: ``engine-core`` (loads the general plugins as ``EngineCore.__init__`` does, then the scheduler) or
``worker`` (as
``WorkerWrapperBase.init_worker`` does: plugins, the platform's Triton overrides, then the platform's worker
class and, on CUDA, Model Runner V2's module too). The announced policy comes from the environment as in a real
engine process (``CORDS_VLLM_ENGINE_POLICY``).

Printed: the ``vllm.v1.worker.cpu*`` modules loaded, the torch and vLLM attributes (those vLLM's CPU worker
replaces when imported) that are no longer the original objects, and the table's entries installed, by target.
"""

from __future__ import annotations

import json
import os
import sys
import types

#: What ``vllm.v1.worker.cpu.shm`` replaces for the whole process when imported: (module, attribute path).
GUARDED = (("torch", "Event"), ("torch", "cuda.Event"), ("torch", "cuda.Stream"), ("torch", "cuda.set_stream"),
           ("torch", "cuda.current_stream"), ("torch", "cuda.stream"), ("torch", "accelerator.synchronize"),
           ("torch", "accelerator.empty_cache"), ("torch", "accelerator.get_memory_info"),
           ("torch", "Tensor.pin_memory"), ("torch", "Tensor.record_stream"),
           ("vllm.utils.torch_utils", "async_tensor_h2d"), ("vllm.v1.worker.gpu.buffer_utils", "UvaBuffer"),
           ("vllm.triton_utils", "tl.debug_barrier"))

#: vLLM's CUDA build's compiled modules that the CUDA worker's imports reach.
COMPILED_CUDA_MODULES = ("vllm._C_stable_libtorch", "vllm.vllm_flash_attn")


class _StandIn(types.ModuleType):
    """A compiled module of the CUDA build: any attribute is a function that must never be called here."""

    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__"):
            raise AttributeError(attr)

        def never(*args: object, **kwargs: object) -> None:
            raise RuntimeError(f"{self.__name__}.{attr} is a stand-in of the CUDA build's compiled module")

        return never


#: Ops of the CUDA build's ``_C`` library that the worker's imports call, with the answer of an H100 build.
CUDA_OPS_ASKED_AT_IMPORT = (("cutlass_scaled_mm_supports_block_fp8(int cuda_device_capability) -> bool", True),)

WORKER_CLASS = {"cuda": "vllm.v1.worker.gpu_worker.Worker", "cpu": "vllm.v1.worker.cpu_worker.CPUWorker"}


_MISSING = object()


def _get(module: str, path: str) -> object:
    """The attribute, or one sentinel where this build lacks it (vLLM's Triton placeholder has no
    ``debug_barrier``)."""
    import importlib

    obj: object = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part, _MISSING)
    return obj


def main(platform: str, role: str) -> dict:
    if platform == "cuda":
        # the CUDA build's compiled extensions, which vLLM's CPU build lacks: empty stand-ins (nothing here runs a
        # kernel; the worker modules only import them)
        for name in COMPILED_CUDA_MODULES:
            sys.modules.setdefault(name, _StandIn(name))
        import torch

        library = torch.library.Library("_C", "FRAGMENT")  # ops of the CUDA build that imports call
        for schema, answer in CUDA_OPS_ASKED_AT_IMPORT:
            library.define(schema)
            library.impl(schema.split("(")[0], lambda *args, answer=answer: answer, "CompositeExplicitAutograd")
        # vLLM's Triton check as on a CUDA build: the build is not "+cpu", and with CUDA_VISIBLE_DEVICES empty
        # (as under Ray) no active driver is required yet, so the real Triton is used, not placeholders
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        import vllm.platforms
        from vllm.platforms.cuda import CudaPlatform

        vllm.platforms.vllm_version_matches_substr = lambda substr: False
        from vllm.platforms.interface import DeviceCapability

        class HopperWithoutDevice(CudaPlatform):
            """vLLM's CUDA platform answering device queries as an H100 would (no driver here)."""

            @classmethod
            def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
                return DeviceCapability(9, 0)

            @classmethod
            def get_device_name(cls, device_id: int = 0) -> str:
                return "NVIDIA H100 80GB HBM3"

        vllm.platforms._current_platform = HopperWithoutDevice()
    from vllm.platforms import current_platform

    platform = str(current_platform.device_type)
    before = {f"{m}:{p}": _get(m, p) for m, p in GUARDED}

    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.utils.import_utils import resolve_obj_by_qualname

    if role == "engine-core":
        import vllm.v1.core.sched.scheduler
        import vllm.v1.engine.core
    else:
        current_platform.register_triton_kernel_overrides()
        resolve_obj_by_qualname(WORKER_CLASS[platform])
        import vllm.v1.worker.gpu_model_runner
        if platform == "cuda":
            import vllm.v1.worker.gpu.model_runner
    if os.environ.get("PROBE_RESOLVE_WHOLE_TABLE") == "1":  # the negative control: the table as it was resolved
        from cords_vllm.integration.patch import table

        table.install_all()

    from cords_vllm.integration.patch import table
    from cords_vllm.integration.patch.mechanism import installed

    imported = [e for e in table.TABLE if e.target.partition(":")[0] in sys.modules]
    return {
        "platform": str(current_platform.device_type),
        "cpu_worker_modules": sorted(m for m in sys.modules if m.startswith("vllm.v1.worker.cpu")),
        "replaced": sorted(name for name, obj in before.items() if _get(*name.split(":")) is not obj),
        "installed": sorted(e.target for e in installed(imported)),
        "hooked_modules": sorted({e.target.partition(":")[0] for e in installed(imported)}),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
