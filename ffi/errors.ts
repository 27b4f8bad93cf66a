// The project's error root, at its lowest floor (ffi imports nothing of the project), and the
// errors raised at the native edge. Each failure mode is its own class with a `name`, so callers
// can branch on it and logs say what failed.

/**
 * Every error meshtrain raises on purpose derives from this: the CLI says any of them in one
 * line (sdk/cli/main.ts), and a service answers one with an error reply carrying its `code`
 * ("" where no reply carries it; services/runtime/mesh/errors.ts rebuilds the class from it).
 */
export class MeshtrainError extends Error {
  override name: string = "MeshtrainError";
  constructor(
    message: string,
    options?: ErrorOptions,
    readonly code: string = "",
  ) {
    super(message, options);
  }
}

/** A configuration value that cannot work (a job option, a model's shape, a learning rate):
 *  the engine's, a service's and the CLI's one class; its code crosses the wire. */
export class ConfigError extends MeshtrainError {
  override name = "ConfigError";
  constructor(message: string, options?: ErrorOptions) {
    super(message, options, "config");
  }
}

export class NativeLibraryError extends MeshtrainError {
  override readonly name = "NativeLibraryError";
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
  }
}

export class OutOfMemoryError extends MeshtrainError {
  override readonly name = "OutOfMemoryError";
  constructor(
    readonly backend: string,
    readonly bytes: number,
  ) {
    super(`${backend}: could not allocate ${bytes} bytes`);
  }
}
