"""Ray Serve deployments. `IMPORT_STARTED_AT`: when this process first imported the package, before any
deployment module's heavy imports (a replica's start-up timeline begins here: `engine.startup.ReplicaStartup`).
`PRELOADED`: this import ran while Ray started the worker process, before any replica was placed in it (the node's
Ray was started with `RAY_preload_python_modules` naming one of our modules: README, "Deploying on a cluster")."""

import os
import sys
import time

IMPORT_STARTED_AT = time.time()

# torch.cuda.is_available() initializes CUDA unless this is set, and diffusers calls it when it is imported
# (diffusers.utils.torch_utils picks its default device). CUDA reads CUDA_VISIBLE_DEVICES once, when it
# initializes: a process that imported diffusers before Ray set the variable for its replica (a worker that
# preloaded our modules) would run every replica on device 0. With NVML answering is_available(), importing our
# code leaves CUDA untouched (measured on 2 H200s; the engine refuses a process where it did not:
# engine.engine.check_cuda_visibility).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def _imported_by_ray_preload(argv: list[str]) -> bool:
    """Ray's worker entry point takes the modules to import before it runs any task as
    `--worker-preload-modules=a,b`; our package is among them when one of them is ours."""
    for arg in argv:
        if arg.startswith("--worker-preload-modules="):
            names = arg.split("=", 1)[1].split(",")
            return any(name == __name__ or name.startswith(__name__ + ".") for name in names)
    return False


PRELOADED = _imported_by_ray_preload(sys.argv)
