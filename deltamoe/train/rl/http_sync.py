"""A trainer pushing weights into a separate `deltamoe serve --weight-updates` process over HTTP + gloo.

The HTTP routes carry the control (`serve/api/weight_routes.py`); the tensors go over a
`TransferGroup` that this trainer opens (rank 0) and the server joins (rank 1). Each blocking
route call runs in a thread while this side does its half of the same collective.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import torch

from deltamoe.errors import RequestError
from deltamoe.serve.engine.weight_transfer import DEFAULT_BUCKET_BYTES, TransferGroup
from deltamoe.train.rl.weight_push import send_over_group, specs_of


class HTTPWeightSync:
    def __init__(self, base_url: str, api_key: str | None = None, host: str = "127.0.0.1",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 300.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)
        self.host, self.bucket_bytes, self.timeout_s = host, bucket_bytes, timeout_s
        self.group: TransferGroup | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deltamoe-weight-sync")

    def connect(self) -> None:
        """Open the transfer group and have the server join it."""
        group = TransferGroup(self.host, 0, 0, 2, self.timeout_s)
        call = self._pool.submit(self._post, "/init_weight_transfer_engine",
                                 {"host": self.host, "port": group.port, "rank": 1, "world_size": 2,
                                  "timeout_s": self.timeout_s})
        group.connect()
        call.result()
        self.group = group

    def push(self, tensors: dict[str, torch.Tensor], abort_running: bool = False) -> dict:
        """One whole update: start, announce + stream the tensors, finish. The server's stats.

        The swap waits for the server's running requests (`abort_running`: aborts them), at most
        nine tenths of this client's timeout, so a slow request ends in the server's 409 rather than
        a bare read timeout. Whatever fails after the start, the update is aborted on the server (best
        effort), so the next push does not find it open."""
        if self.group is None:
            self.connect()
        self._post("/start_weight_update")
        try:
            self._send(tensors)
            return self._post("/finish_weight_update", {"running": "abort" if abort_running else "wait",
                                                        "timeout_s": 0.9 * self.timeout_s})
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Drop the server's open update, if any (its old weights keep serving); errors are ignored."""
        try:
            self.http.post("/abort_weight_update")
        except httpx.HTTPError:
            pass

    def _send(self, tensors: dict[str, torch.Tensor]) -> None:
        specs = specs_of(tensors)
        body = {"names": [s.name for s in specs], "dtype_names": [s.dtype for s in specs],
                "shapes": [list(s.shape) for s in specs], "bucket_bytes": self.bucket_bytes}
        call = self._pool.submit(self._post, "/update_weights", body)
        try:
            send_over_group(self.group, tensors, self.bucket_bytes)
        except RequestError:
            call.result()  # the server's answer names the tensor it rejected
            raise
        except Exception:  # the group failed (a timeout, the server gone): the next push opens a new one
            self.group = None
            raise
        call.result()

    def _post(self, path: str, body: dict | None = None) -> dict:
        r = self.http.post(path, json=body) if body is not None else self.http.post(path)
        if r.status_code >= 400:
            error = r.json().get("error", {})
            raise RequestError(f"{path}: {error.get('message', r.text)}", field=error.get("param") or "weights")
        return r.json()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.http.close()
