from typing import List, Optional, Tuple

__version__: str

def call(args: List[str], capture: bool = True) -> Tuple[int, str, Optional[str]]:
    """Runs the rlmerge command line with ``args`` (no program name) in this process.

    Returns (exit code, captured output — empty unless ``capture`` —, error line or None). Exit
    codes: 0 success, 1 failure, 2 usage error, 130 interrupted. The GIL is released while it
    runs; Ctrl-C stops it at its next tile and raises KeyboardInterrupt here.
    """
