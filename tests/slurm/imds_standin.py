"""A stand-in for the EC2 instance metadata service (IMDSv2), run on a test node's loopback.

PUT /latest/api/token returns a token; GETs must carry it (401 otherwise). The spot instance-action
document is served (200) once the file given as --notice exists, and the rebalance recommendation
once the file given as --rebalance exists; 404 before, as EC2 does. Standard library only (the
node's system python3).

    python3 imds_standin.py --port 18080 --notice /tmp/spot-notice.json --rebalance /tmp/rebalance.json
"""

from __future__ import annotations

import argparse
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "standin-token"


def handler(documents: dict[str, str]):
    """`documents`: metadata path -> the file whose content is served there once it exists."""

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: str = "") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:
            if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                self._send(200, TOKEN)
            else:
                self._send(400)

        def do_GET(self) -> None:
            if self.headers.get("X-aws-ec2-metadata-token") != TOKEN:
                self._send(401)
            elif self.path in documents and os.path.exists(documents[self.path]):
                with open(documents[self.path]) as f:
                    self._send(200, f.read())
            else:
                self._send(404)

        def log_message(self, *args) -> None:
            pass

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--notice", required=True, help="file holding the instance-action document")
    parser.add_argument("--rebalance", required=True, help="file holding the rebalance recommendation")
    args = parser.parse_args()
    documents = {"/latest/meta-data/spot/instance-action": args.notice,
                 "/latest/meta-data/events/recommendations/rebalance": args.rebalance}
    ThreadingHTTPServer(("127.0.0.1", args.port), handler(documents)).serve_forever()


if __name__ == "__main__":
    main()
