"""Ray Serve deployments. `IMPORT_STARTED_AT`: when this process first imported the package, before any
deployment module's heavy imports (a replica's start-up timeline begins here: `engine.startup.ReplicaStartup`)."""

import time

IMPORT_STARTED_AT = time.time()
