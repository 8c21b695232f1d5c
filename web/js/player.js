// Plays mono float samples through the jitter-buffer AudioWorklet and keeps its figures.
export class Player {
  constructor(sampleRate, prebufferMs = 80) {
    this.sampleRate = sampleRate;
    this.prebufferMs = prebufferMs;
    this.stats = {played: 0, underruns: 0, buffered: 0, playing: false};
    this.onStats = () => {};
  }

  async start() {
    this.context = new AudioContext({sampleRate: this.sampleRate, latencyHint: "interactive"});
    await this.context.audioWorklet.addModule(new URL("./jitter-buffer.worklet.js", import.meta.url));
    this.node = new AudioWorkletNode(this.context, "jitter-buffer", {
      outputChannelCount: [1],
      processorOptions: {prebufferSamples: Math.round(this.sampleRate * this.prebufferMs / 1000)},
    });
    this.node.port.onmessage = (event) => {
      this.stats = event.data;
      this.onStats(this.stats);
    };
    this.node.connect(this.context.destination);
  }

  resume() {
    return this.context.resume();
  }

  push(samples) {
    this.node.port.postMessage({type: "audio", samples}, [samples.buffer]);
  }

  end() {
    this.node.port.postMessage({type: "end"});
  }

  clear() {
    this.node.port.postMessage({type: "clear"});
  }

  get bufferedMs() {
    return this.stats.buffered / this.sampleRate * 1000;
  }
}
