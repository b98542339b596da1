"""What `odc compare --plot` and `odc simulate --plot` run: a drawer that reads the command's JSON
document on stdin and writes the figure, with every failure one line on stderr (usage and
unknown formats exit 2, a missing matplotlib or an unwritable file 1)."""

from __future__ import annotations

import json
import sys
from typing import Callable, List


def draw_from_stdin(
    program: str,
    usage: str,
    source: str,
    key: str,
    draw: Callable[[dict, str, str], None],
    argv: List[str],
) -> int:
    """`usage` (e.g. `python -m odc.compare_plot FILE.png [TITLE] < compare.json`): `key` must be
    in the document on stdin (`odc <source> --format json`), then draw(document, FILE, TITLE).
    Errors start with `program: error:`."""
    if not 1 <= len(argv) <= 2:
        print(f"usage: {usage}", file=sys.stderr)
        return 2
    if not argv[0]:  # matplotlib would write '.png' in the current directory
        print(f"{program}: error: the plot's file name is empty (usage: {usage})", file=sys.stderr)
        return 2
    not_json = f"{program}: error: stdin is not `odc {source} --format json`"
    try:
        document = json.load(sys.stdin)
        document[key]
    except RecursionError:  # arrays or objects nested thousands deep: json's decoder recurses
        print(f"{not_json}: nested too deeply", file=sys.stderr)
        return 2
    except (ValueError, KeyError, TypeError) as error:
        print(f"{not_json}: {_describe(error)}", file=sys.stderr)
        return 2
    try:
        draw(document, argv[0], argv[1] if len(argv) > 1 else "")
    except (KeyError, TypeError, IndexError, AttributeError) as error:
        # The document parsed, but its rows are not the command's (a field missing or of
        # another type): the drawer's lookups fail.
        print(f"{not_json}: {_describe(error)}", file=sys.stderr)
        return 2
    except ImportError:
        print(
            f"{program}: error: drawing needs matplotlib: pip install matplotlib "
            "(or the extra: pip install 'odc[plot]')",
            file=sys.stderr,
        )
        return 1
    except ValueError as error:  # matplotlib: a format it does not know, e.g. out.txt
        print(f"{program}: error: cannot write {argv[0]}: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(
            f"{program}: error: cannot write {argv[0]}: {error.strerror or error}", file=sys.stderr
        )
        return 1
    return 0


def _describe(error: Exception) -> str:
    """A KeyError's text is the bare key ('results'): say that it is a missing field."""
    return f"no field {error}" if isinstance(error, KeyError) else str(error)
