"""``python -m rollout_engine.launch_server`` (SGLang's spelling); see
``rollout_engine.entrypoints.launch_server``."""

import sys

from rollout_engine.entrypoints.launch_server import main

if __name__ == "__main__":
    sys.exit(main())
