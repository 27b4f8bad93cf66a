// The last lines of a local training command: where the model went and the commands that use
// it, with the path as the user would type it from where they ran the command.
import { cliName, shellWord, shownPath } from "../user-paths.ts";

/** `commands` are meshtrain subcommands taking --model, each with its extra arguments. */
export function modelLines(modelPath: string, commands: readonly (readonly string[])[]): string[] {
  const model = shownPath(modelPath);
  return [
    `model: ${model}`,
    ...commands.map(
      ([name, ...extra]) =>
        `next: ${[name!, "--model", model, ...extra].map(shellWord).reduce((line, w) => `${line} ${w}`, cliName())}`,
    ),
  ];
}
