"""Adapter for StreamFlow 0.2.0rc3's directory listings: ``no_listing`` means no listing.

CWL v1.2 gives every Directory port ``loadListing: no_listing`` unless it asks for more, and a
Directory's ``listing`` is then absent. Upstream's ``streamflow.cwl.utils.update_file_token``
computes one anyway whenever the token has none: its branch for ``no_listing`` only deletes
a listing that is present, and the next branch lists a directory that has none. Listing
opens every entry and checksums every file (sha1). For xffl that means:

* every update and every global model is read once more, in full, on its way to the next
  step (gigabytes per site and round for a large model), before xffl reads it to check it;
* a facility can stop the whole workflow by putting in its update an entry StreamFlow cannot
  list (a dangling symbolic link, a FIFO): the listing fails in a step that StreamFlow cannot
  recover (a token transformer), where no failure manager is asked.

:func:`install` (called by xffl's StreamFlow plugin) wraps the function so that a Directory
token without a listing on a ``no_listing`` port is left as it is, as the CWL standard says;
everything else goes to upstream's code unchanged. ``tests/workflows/extensions/test_listing.py``
shows the upstream behaviour.
"""

from __future__ import annotations

from typing import Any

_MARK = "_xffl_no_listing"


def install() -> None:
    """Wrap ``streamflow.cwl.utils.update_file_token`` (once per process)."""
    import streamflow.cwl.utils as sf_cwl_utils
    from streamflow.cwl.utils import LoadListing

    original = sf_cwl_utils.update_file_token
    if getattr(original, _MARK, False):
        return

    async def update_file_token(context: Any, connector: Any, cwl_version: str, location: Any,
                                token_value: Any, load_contents: bool | None,
                                load_listing: Any = None) -> Any:
        if (load_listing == LoadListing.no_listing and isinstance(token_value, dict)
                and token_value.get("class") == "Directory" and "listing" not in token_value):
            load_listing = None  # nothing to delete, nothing to compute
        return await original(context, connector, cwl_version, location, token_value,
                              load_contents, load_listing)

    setattr(update_file_token, _MARK, True)
    update_file_token.__wrapped__ = original  # type: ignore[attr-defined]
    sf_cwl_utils.update_file_token = update_file_token
