// Command deviceplugin advertises simulated GPUs to a real kubelet through the kubelet's device plugin API,
// as NVIDIA's plugin advertises real ones: the resource (nvidia.com/gpu) with --count healthy devices, and
// for each container the kubelet allocates devices to, the visible devices in its environment
// (NVIDIA_VISIBLE_DEVICES with the device IDs, CUDA_VISIBLE_DEVICES with their indices). No device node is
// created: the machine has none. Registers again when the kubelet restarts (it removes the plugins' sockets).
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices []*pluginapi.Device
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

// ListAndWatch sends the device list once; the devices never change, so the stream then waits for its end.
func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

func (p *plugin) GetPreferredAllocation(context.Context, *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	return &pluginapi.PreferredAllocationResponse{}, nil
}

func (p *plugin) Allocate(_ context.Context, request *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	response := &pluginapi.AllocateResponse{}
	for _, container := range request.ContainerRequests {
		indices := make([]string, 0, len(container.DevicesIds))
		for _, id := range container.DevicesIds {
			index, ok := strings.CutPrefix(id, "gpu-")
			if !ok {
				return nil, fmt.Errorf("unknown device %q", id)
			}
			indices = append(indices, index)
		}
		log.Printf("allocate %v", container.DevicesIds)
		response.ContainerResponses = append(response.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{
				"NVIDIA_VISIBLE_DEVICES": strings.Join(container.DevicesIds, ","),
				"CUDA_VISIBLE_DEVICES":   strings.Join(indices, ","),
			},
		})
	}
	return response, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

// serve listens on the plugin's socket and registers it with the kubelet; returns the server once registered.
func serve(p *plugin, dir, endpoint, resource string) (*grpc.Server, error) {
	socket := filepath.Join(dir, endpoint)
	_ = os.Remove(socket)
	listener, err := net.Listen("unix", socket)
	if err != nil {
		return nil, err
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, p)
	go func() { _ = server.Serve(listener) }()
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, filepath.Base(pluginapi.KubeletSocket)),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		server.Stop()
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: endpoint, ResourceName: resource,
	})
	if err != nil {
		server.Stop()
		return nil, err
	}
	return server, nil
}

func main() {
	count := flag.Int("count", 4, "devices to advertise")
	resource := flag.String("resource", "nvidia.com/gpu", "the extended resource's name")
	dir := flag.String("dir", pluginapi.DevicePluginPath, "the kubelet's device plugin directory")
	endpoint := flag.String("endpoint", "iwg-gpu.sock", "this plugin's socket, in --dir")
	flag.Parse()
	p := &plugin{}
	for i := 0; i < *count; i++ {
		p.devices = append(p.devices, &pluginapi.Device{ID: fmt.Sprintf("gpu-%d", i), Health: pluginapi.Healthy})
	}
	socket := filepath.Join(*dir, *endpoint)
	for {
		server, err := serve(p, *dir, *endpoint, *resource)
		if err != nil {
			log.Printf("not registered yet: %v", err)
			time.Sleep(500 * time.Millisecond)
			continue
		}
		log.Printf("registered %d x %s at %s", *count, *resource, socket)
		// A kubelet that starts again removes every plugin socket: then register again.
		for {
			time.Sleep(500 * time.Millisecond)
			if _, err := os.Stat(socket); err != nil {
				break
			}
		}
		server.Stop()
		log.Printf("socket gone (kubelet restarted): registering again")
	}
}
