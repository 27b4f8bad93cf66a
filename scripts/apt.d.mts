// Types of scripts/apt.mjs for the TypeScript that imports it (the tests); the script itself
// stays plain JavaScript so that Node runs it before any package is installed.
export function hasPackageLists(listFileNames: readonly string[]): boolean;
export function packagesWithoutCandidate(policyText: string, pkgs: readonly string[]): string[];
export function aptUpdateReason(listFileNames: readonly string[], policyText: string, pkgs: readonly string[]): string | null;
