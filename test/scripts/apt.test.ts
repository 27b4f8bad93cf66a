// scripts/bootstrap.mjs runs `apt-get update` before installing exactly when apt cannot see the
// packages yet. The decision is a pure function of apt's output, checked here on captured
// output (this test needs neither root nor a network, and changes nothing on the machine).
import { describe, expect, test } from "bun:test";
import { aptUpdateReason, hasPackageLists, packagesWithoutCandidate } from "../../scripts/apt.mjs";

const lists = [
  "lock",
  "partial",
  "auxfiles",
  "deb.debian.org_debian_dists_bookworm_InRelease",
  "deb.debian.org_debian_dists_bookworm_main_binary-amd64_Packages.lz4",
];

// `LC_ALL=C apt-cache policy nats-server flatbuffers-compiler` on bookworm with package lists
const seen = `nats-server:
  Installed: (none)
  Candidate: 2.9.10-1+b3
  Version table:
     2.9.10-1+b3 500
        500 http://deb.debian.org/debian bookworm/main amd64 Packages
flatbuffers-compiler:
  Installed: (none)
  Candidate: 2.0.8+dfsg1-2
  Version table:
     2.0.8+dfsg1-2 500
        500 http://deb.debian.org/debian bookworm/main amd64 Packages
`;

describe("when bootstrap runs apt-get update first", () => {
  test("package lists are found plain or compressed, and not from the lock or the InRelease files", () => {
    expect(hasPackageLists(lists)).toBe(true);
    expect(hasPackageLists(["x_main_binary-amd64_Packages"])).toBe(true);
    expect(hasPackageLists(["x_main_binary-amd64_Packages.xz"])).toBe(true);
    expect(hasPackageLists(["lock", "partial", "auxfiles", "deb.debian.org_debian_dists_bookworm_InRelease"])).toBe(
      false,
    );
    expect(hasPackageLists([])).toBe(false);
  });

  test("apt-cache policy: a candidate version is seen; '(none)' or no entry at all is not", () => {
    expect(packagesWithoutCandidate(seen, ["nats-server", "flatbuffers-compiler"])).toEqual([]);
    // no lists, nothing installed: apt-cache prints nothing for a name it does not know
    expect(packagesWithoutCandidate("", ["nats-server", "gcc"])).toEqual(["nats-server", "gcc"]);
    const virtualOnly = "libc-dev:\n  Installed: (none)\n  Candidate: (none)\n  Version table:\n";
    expect(packagesWithoutCandidate(seen + virtualOnly, ["nats-server", "libc-dev", "g++"])).toEqual([
      "libc-dev",
      "g++",
    ]);
  });

  test("the reason printed before apt-get update, or null when install can go straight on", () => {
    expect(aptUpdateReason(["lock", "partial"], "", ["gcc"])).toBe("no Debian package lists yet");
    expect(aptUpdateReason([], seen, ["nats-server"])).toBe("no Debian package lists yet");
    expect(aptUpdateReason(lists, seen, ["nats-server"])).toBeNull();
    expect(aptUpdateReason(lists, seen, ["nats-server", "g++"])).toBe("apt's package lists have no g++");
  });
});
