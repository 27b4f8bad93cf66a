// Errors raised at the native edge. Each failure mode is its own class with a `name`, so
// callers can branch on it and logs say what failed.

export class NativeLibraryError extends Error {
  override readonly name = "NativeLibraryError";
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
  }
}

export class OutOfMemoryError extends Error {
  override readonly name = "OutOfMemoryError";
  constructor(
    readonly backend: string,
    readonly bytes: number,
  ) {
    super(`${backend}: could not allocate ${bytes} bytes`);
  }
}
