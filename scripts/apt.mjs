// What scripts/bootstrap.mjs asks apt before it installs: can apt see the packages at all? A
// fresh Debian machine (or container) has no package lists, so `apt-get install` would fail
// with one "E: Unable to locate package" per package; then `apt-get update` must run first.
// Pure functions of apt's output, so a test can check them without root or a network.

/** Whether a package-lists folder's file names include a Packages index (plain or compressed). */
export function hasPackageLists(listFileNames) {
  return listFileNames.some((name) => /_Packages(\.(gz|xz|lz4|zst|bz2))?$/.test(name));
}

/**
 * The packages of `pkgs` that `apt-cache policy <pkgs...>` output shows with "Candidate: (none)"
 * or does not list at all (apt prints nothing for a name it has never heard of).
 */
export function packagesWithoutCandidate(policyText, pkgs) {
  const candidates = new Map();
  let current = null;
  for (const line of policyText.split("\n")) {
    const header = /^(\S+):$/.exec(line);
    if (header !== null) current = header[1];
    const candidate = /^\s+Candidate:\s*(.+)$/.exec(line);
    if (candidate !== null && current !== null) candidates.set(current, candidate[1].trim());
  }
  return pkgs.filter((p) => {
    const c = candidates.get(p);
    return c === undefined || c === "(none)";
  });
}

/**
 * Why `apt-get update` must run before installing `pkgs`, or null when apt can see them all.
 * listFileNames: the names in /var/lib/apt/lists; policyText: `apt-cache policy <pkgs...>`.
 */
export function aptUpdateReason(listFileNames, policyText, pkgs) {
  if (!hasPackageLists(listFileNames)) return "no Debian package lists yet";
  const unseen = packagesWithoutCandidate(policyText, pkgs);
  if (unseen.length > 0) return `apt's package lists have no ${unseen.join(", ")}`;
  return null;
}
