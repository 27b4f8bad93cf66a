#!/bin/sh
# The images' production dependencies (the deps stage of deploy/Dockerfile and Dockerfile.gpu),
# run in /app beside package.json and package-lock.json, with Node and no npm: npm itself comes
# from the npm registry, its tarball checked against the integrity pinned here. Debian's npm
# package brings 382 packages, which took 101 s of a 2-core machine's cold build (nodejs alone:
# 17 packages, 20 s).
#   NPM_REGISTRY   a mirror of the npm registry (default: the registry itself)
#   EXTRA_CA_CERT  the PEM text of a certificate authority the registry's traffic goes through
#                  (a proxy that re-signs TLS); empty where it reaches the registry directly
set -eu
registry=${NPM_REGISTRY:-https://registry.npmjs.org}
registry=${registry%/}
version=10.9.4
integrity=sha512-OnUG836FwboQIbqtefDNlyR0gTHzIfwRfE3DuiNewBvnMnWEpB0VEXwBlFVgqpNzIgYo/MHh3d2Hel/pszapAA==
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -n "${EXTRA_CA_CERT:-}" ]; then
  printf '%s\n' "$EXTRA_CA_CERT" > "$work/extra-ca.pem"
  export NODE_EXTRA_CA_CERTS="$work/extra-ca.pem"
fi
node --input-type=module - "$registry/npm/-/npm-$version.tgz" "$integrity" "$work/npm.tgz" <<'EOF'
import { createHash } from "node:crypto";
import { writeFileSync } from "node:fs";
const [url, want, out] = process.argv.slice(2);
const res = await fetch(url);
if (!res.ok) throw new Error(`${url}: HTTP ${res.status}`);
const bytes = Buffer.from(await res.arrayBuffer());
const got = `sha512-${createHash("sha512").update(bytes).digest("base64")}`;
if (got !== want) throw new Error(`${url}: integrity ${got}, not the pinned ${want}`);
writeFileSync(out, bytes);
EOF
mkdir "$work/npm"
tar -xzf "$work/npm.tgz" -C "$work/npm" --strip-components=1
node "$work/npm/bin/npm-cli.js" ci --omit=dev --no-audit --no-fund --cache "$work/cache" --registry "$registry/"
# bun's postinstall moved this platform's binary into node_modules/bun/bin; an npm that ignores
# the packages' libc field (Debian's npm 9 did) also installs the musl build (100 MB) beside it
if [ "$(stat -c %s node_modules/bun/bin/bun.exe)" -gt 1048576 ]; then rm -rf node_modules/@oven; fi
